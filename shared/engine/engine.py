"""The engine: requests in, tokens out, one `step()` at a time.

Single-threaded by design: the worker processes call it from one loop thread and feed it
through a queue. Prefill and decode workers use the same class: `prefill_only` requests
stop after their first token and hold their pages for the KV transfer; reservations and
`add_prefilled` let a decode worker receive KV computed elsewhere. What one step does, and
where each part lives: docs/ARCHITECTURE.md, "The engine step"."""
from __future__ import annotations

import logging
import os
import threading
import time
import uuid
import weakref
from collections import deque
from dataclasses import dataclass, replace

import torch

from shared.admission.context_rule import completion_budget
from shared.admission.kv_demand import check_fits, kv_demand

from . import engine_parts as parts
from .attention.select import make_attention_backend
from .cache_scope import DEFAULT_SCOPE, CacheScope
from .config import CPU_DEFAULT_KV_BYTES, EngineConfig
from .kv_manager import KVManager
from .kv_pool import KVLayout, KVPool
from .model_config import ModelConfig
from .model_runner import ModelRunner
from .models.loader import load_model
from .outputs import StepOutput
from .plan import Decision
from .plan_resolve import probe_device, resolve_plan
from .request import Req, ReqStatus
from . import logit_constraints
from .sampler import SampleRow, sample
from .sampling_params import SamplingParams
from .scheduler import Scheduler
from .sequence_group import SequenceGroups
from .startup_phases import StartupPhases

log = logging.getLogger("duet.engine")

PIN_IDLE_S = 0.05  # no step launched or running for this long: the host tier's locking may take a chunk
AHEAD_STEPS = 4  # the host tier writes back while fewer free device pages than this many steps take (_write_back)


@dataclass
class EngineStats:
    steps: int = 0
    prefill_tokens_computed: int = 0  # prompt tokens whose KV this engine computed
    decode_tokens_computed: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (every tier)
    host_cached_tokens: int = 0  # of those, tokens loaded back from the host tier
    requests_finished: int = 0


class Engine:
    def __init__(self, config: EngineConfig | None = None, **overrides):
        """Build the engine from its plan (plan.py): every start-time choice is resolved once
        from the settings, the device and the model's config, then each part is made from it."""
        self.config = config = (config or EngineConfig()).with_options(**overrides)
        # where start-up time goes (startup_phases.py): a worker adds its own and logs them
        self.startup = startup = StartupPhases()
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        from shared.model_files.default_model import resolve_model_dir
        with startup.phase("model files"):  # (the embedded default model is converted once)
            self.model_dir = resolve_model_dir(config.model_dir)
            self.model_config = mc = ModelConfig.from_dir(self.model_dir, quantization=config.quantization)
        with startup.phase("device"):
            facts = probe_device(config.resolve_device())
        self.plan = plan = resolve_plan(config, mc, facts)
        # per-rank services a worker attaches (e.g. a follower's KV transfer agent, see
        # shared/kv_transfer/rank_transfers.py); the follower loop gives them idle ticks
        self.rank_services: dict[str, object] = {}
        self._tp_workers = None
        if config.tp_size > 1 and config.tp.size == 1:  # this process becomes rank 0 of tp_size
            from .parallel.launcher import launch
            with startup.phase("tp ranks"):
                config.tp, self._tp_workers = launch(config, config.tp_size, config.resolve_device())
            weakref.finalize(self, self._tp_workers.shutdown)
        self.tp = config.tp
        self.device = torch.device(plan.device.value)
        self.dtype, self.kv_dtype = getattr(torch, plan.dtype.value), getattr(torch, plan.kv_dtype.value)
        self.max_model_len = plan.max_model_len.value
        t0 = time.monotonic()
        if self.device.type == "cuda":
            with startup.phase("device"):
                torch.cuda.set_device(self.device)
        with startup.phase("weights"):
            self.model = load_model(mc, self.tp, self.dtype, self.device, self.max_model_len,
                                    fused=plan.kernels.value, load_format=config.load_format,
                                    expert_parallel=config.ep_size > 1)
            self.weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
            self.fp8_layers = sum(1 for m in self.model.modules() if getattr(m, "fp8", None))
            self.small_batch_workspace = parts.route_linears(self.model, plan, self.device)
        with startup.phase("lora"):  # LoRA slots before the KV is sized: on a GPU their memory comes out of its budget
            self.lora = parts.lora_manager(self.model, mc, config, plan, self.dtype, self.device)
        if plan.custom_all_reduce.value is not None:
            with startup.phase("all-reduce"):
                failed = parts.attach_custom_all_reduce(self.tp, self.device, plan.custom_all_reduce.value)
            if failed:  # NCCL instead, and the graph and overlap choices that depend on it
                self.plan = plan = resolve_plan(config, mc, plan.facts, custom_all_reduce_failed=failed)
        self.spec = None  # speculative decoding (speculative/speculator.py): rank 0 drafts, every rank verifies
        if plan.speculative.value is not None:
            from .speculative.speculator import Speculator
            with startup.phase("draft model"):
                self.spec = Speculator(self, config)
        with startup.phase("kv pool"):
            self.layout = self._size_kv()
            self.pool = KVPool(self.layout, self.device, self._kv_scales())
            self.backend = make_attention_backend(plan.attention.value, self.pool)
            self.pdl = parts.enable_decode_pdl(self.model, self.backend, plan.pdl.value)
        # _may_pin's state: the pinning thread asks it from the moment the host tier exists
        self._pinning_open = False  # until the graphs are captured
        self._stepping = False  # inside step()
        self.overlap = None  # the overlap scheduler, made after the graphs
        with startup.phase("host tier"):
            host_tier = self._make_host_tier()
        self.kv = KVManager(self.layout.num_pages, self.layout.page_size, config.enable_prefix_cache,
                            host_tier=host_tier, quota=config.tenant_quota, write_back=self._write_back())
        self.scheduler = Scheduler(self.kv, plan.step_tokens.value, config.max_running_requests, self.lora)
        self.runner = ModelRunner(self.model, self.pool, self.backend, self.device)
        if self._tp_workers is not None:
            self.runner.plan_sink = self._tp_workers.send_plan
        if self.lora is not None:
            self.runner.lora = self.lora.step
            if self._tp_workers is not None:  # followers write the slot rank 0 chose, each its shard
                self.lora.mirror = lambda name, path, slot: self.call_followers(
                    "shared.engine.lora.manager:follower_write_slot", name, path, slot)
            self.lora.step.forced = True  # graphs captured from here on carry the LoRA launches
        with startup.phase("graphs"):
            self._make_graphs()
        self.requests: dict[str, Req] = {}
        self.kv.live_requests = self.requests.values  # their pages count against their tenants
        # launched steps whose prefill-only KV a transfer may not read yet: (event, [(req, end)])
        self._kv_in_flight: deque = deque()
        self.groups = SequenceGroups(self)  # n > 1 requests
        self.stats = EngineStats()
        self._tokenizer = None
        self._grammars = None
        self._grammar_lock = threading.Lock()
        if self.plan.overlap.value:
            from .overlap import OverlapScheduler
            self.overlap = OverlapScheduler(self)
        if self.spec is not None:
            self.spec.attach()
        if self.lora is not None:
            self.lora.step.forced = False
        if self._tp_workers is not None:
            with startup.phase("tp ranks"):
                self._tp_workers.wait_ready()
        self._pinning_open = True
        log.info("engine ready in %.1fs: %s, weights %.2f GiB (%s), KV %d pages x %d tokens (%.2f GiB)",
                 time.monotonic() - t0, mc.architecture, self.weight_bytes / 2**30, self.weights_description,
                 self.layout.num_pages, self.layout.page_size,
                 self.layout.num_pages * self.layout.bytes_per_page / 2**30)
        log.info("engine plan: %s", self.plan.render())

    def _make_graphs(self) -> None:
        """Decode graphs (or their padded eager runner) and the graphs of small prefill and mixed
        steps, as planned."""
        graphs = self.plan.decode_graphs.value
        max_pages = -(-self.max_model_len // self.layout.page_size)
        if graphs is not None:
            self.runner.graphs = parts.decode_graphs(self.model, self.backend, self.pool, self.device, graphs,
                                                     max_pages)
        if self.plan.prefill_graphs.value:  # small prefill and mixed steps are as launch-bound
            self.runner.prefill_graphs, failed = parts.prefill_graphs(
                self.model, self.backend, self.device, self.plan.prefill_graphs.value, max_pages,
                graphs.sizes[-1] if graphs is not None else 0)
            if failed:  # a model whose prefill path cannot be captured
                log.warning("prefill CUDA graphs off (%s); prefill steps run eagerly", failed)
                self.plan = replace(self.plan, prefill_graphs=Decision(0, "off", failed))

    def call_followers(self, target: str, *args) -> list:
        """Run `module:function(engine, *args)` on tensor-parallel ranks 1..N-1 (results in
        rank order; [] without TP). Call from the thread that steps the engine: the calls
        share the control pipe with the step plans."""
        return [] if self._tp_workers is None else self._tp_workers.call(target, *args)

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (also done when the engine is collected) and the
        host tier's background page-locking."""
        if self.kv.cache.host is not None:
            self.kv.cache.host.close()
        if self._tp_workers is not None:
            self._tp_workers.shutdown()

    @property
    def weights_description(self) -> str:
        """What the weights are, for logs: "FP8 block 128x128 (fp8), 252 layers", "dequantized
        from FP8 ..." on a device that holds them in the engine's dtype, or the dtype."""
        q = self.model_config.quant
        if q is None:
            return str(self.dtype).removeprefix("torch.")
        if self.fp8_layers:
            return f"{q.describe()}, {self.fp8_layers} FP8 layers"
        return f"{str(self.dtype).removeprefix('torch.')}, dequantized from {q.describe()}"

    def _kv_scales(self) -> list[tuple[float, float]] | None:
        """An FP8 pool's per-layer scales (the checkpoint's k_scale / v_scale, else 1.0)."""
        if self.kv_dtype != torch.float8_e4m3fn:
            return None
        return [(float(layer.self_attn.k_scale), float(layer.self_attn.v_scale)) for layer in self.model.layers]

    @property
    def kv_heads(self):
        """The global KV heads this rank's pool holds (parallel/context.py HeadSlice)."""
        return self.tp.kv_heads(self.model_config.num_kv_heads)

    # -- sizing -------------------------------------------------------------------------
    def _size_kv(self) -> KVLayout:
        mc, cfg = self.model_config, self.config
        kw = dict(num_layers=mc.num_layers, num_kv_heads=self.tp.kv_heads(mc.num_kv_heads).count,
                  page_size=cfg.page_size, head_dim=mc.head_dim, dtype=self.kv_dtype)
        if cfg.kv_cache_memory:
            budget = cfg.kv_cache_memory
        elif self.device.type == "cpu":
            budget = CPU_DEFAULT_KV_BYTES
        else:
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            budget = int(total * cfg.mem_fraction) - used - (1 << 30)  # 1 GiB for activations/graphs
            if budget <= 0:
                raise MemoryError(f"no GPU memory left for the KV cache at mem_fraction={cfg.mem_fraction}")
        if self.spec is not None and self.spec.kv_bytes_per_token:
            # a draft model keeps KV for the same tokens: split the budget by bytes per token
            own = KVLayout(num_pages=1, **kw).bytes_per_token
            budget = budget * own // (own + self.spec.kv_bytes_per_token)
        layout = KVLayout.pages_for_budget(budget, **kw)
        if self.tp.size > 1:  # every rank must hold the same pages: take the smallest
            pages = self.tp.min_across_ranks(layout.num_pages, self.device)
            layout = KVLayout(num_pages=pages, **kw)
        return layout

    def _make_host_tier(self):
        """The host-memory tier under the KV pool (kv_host_tier.py), or None.

        The budget is the worker's, all its ranks together: each of a TP worker's ranks pins
        its shard of every host page (budget / tp bytes), not the whole budget again, and all
        ranks hold the same page count (each rank's free memory is read at its own moment)."""
        planned, ranks = self.plan.host_tier.value, self.tp.size
        if planned is None:
            return None
        budget = planned.budget
        if budget is None:  # auto: twice the device pool, at most the plan's cap
            budget = min(2 * self.layout.num_pages * self.layout.bytes_per_page * ranks, planned.cap)
        pages = self.tp.min_across_ranks(int(budget) // (self.layout.bytes_per_page * ranks), self.device)
        if pages < 1:
            return None
        from .kv_host_tier import HostKVTier
        tier = HostKVTier(self.pool.buffer, self.layout, pages, may_pin=self._may_pin)
        if self._tp_workers is not None:  # every rank copies the same pages of its shard
            tier.mirror = lambda kind, src, dst, ticket: self.call_followers(
                "shared.engine.kv_host_tier:follower_copy", kind, src, dst, ticket)
            tier.landed_hook = lambda after, upto: self.call_followers(
                "shared.engine.kv_host_tier:follower_landed", after, upto)
            if tier.pinner is not None:  # pages are used once every rank has locked them
                tier.followers_pinned = lambda: self.call_followers("shared.engine.kv_host_tier:follower_pinned")
        writes = self.config.host_writes
        gib = pages * self.layout.bytes_per_page / 2**30
        if tier.pinner is not None:
            self.startup.note("host tier", f"{gib:.1f} GiB page-locked in the background")
        log.info("host KV tier: %d pages (%.2f GiB%s%s), write-back %s, at most %s", pages, gib,
                 f" on each of {ranks} ranks" if ranks > 1 else "",
                 ", page-locking in the background" if tier.pinner is not None else "", writes.policy,
                 f"{writes.bandwidth / 1e9:.1f} GB/s" if writes.bandwidth else "unbounded")
        return tier

    def _may_pin(self) -> bool:
        """The host tier's background locking may take the next chunk (pinned_memory.py): once
        start-up has captured the graphs, while no step is being built or runs on the device (the
        overlap scheduler's launched step not yet read back), and none was launched for PIN_IDLE_S.
        A registration holds the driver's lock the next launch waits on, and a step still running
        is no pause however long ago it was launched (an 8192-token prefill chunk of an 8B model
        runs ~0.2 s; on one H200 at saturation the tier got turns under load: 62 GiB in 105 s)."""
        if not self._pinning_open:  # start-up: called from the host tier's making on (a raise here
            return False  # would stop the locking for good, leaving the whole tier unused)
        overlap = self.overlap
        running = self._stepping or (overlap is not None and overlap.pending is not None)
        return not running and time.monotonic() - self.runner.last_forward_at > PIN_IDLE_S

    def _write_back(self):
        """What is written back to the host tier (kv_write_back.py): the settings' policy and
        bound, and how close to running out the device pool starts writing: a sixteenth of it,
        or four steps' worth of pages when that is more (a copy lands about a step after it is
        queued: 0.17 s at 8k-token prefill steps of an 8B model on an H200)."""
        from .kv_write_back import WriteBackConfig
        writes, pages = self.config.host_writes, self.layout.num_pages
        step_pages = -(-self.plan.step_tokens.value // self.layout.page_size)
        return WriteBackConfig(writes.policy, writes.bandwidth, min(pages, max(pages // 16, AHEAD_STEPS * step_pages)))

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from transformers import AutoTokenizer
            self._tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        return self._tokenizer

    @property
    def grammars(self):
        """The xgrammar backend (grammar.py), made at the first constrained request; it
        needs the model's tokenizer. Thread-safe: RPC handlers compile on it ahead."""
        with self._grammar_lock:
            if self._grammars is None:
                from .grammar import GrammarBackend
                try:
                    tokenizer = self.tokenizer
                except (OSError, ValueError) as exc:
                    raise ValueError(f"constrained decoding needs the model's tokenizer: {exc}") from None
                self._grammars = GrammarBackend(tokenizer, self.model_config.vocab_size,
                                                self.model_config.eos_token_ids,
                                                cache_size=self.config.grammar_cache_size)
        return self._grammars

    # -- requests -----------------------------------------------------------------------
    def _make_req(self, prompt_ids, params: SamplingParams, rid, prefill_only,
                  scope: CacheScope = DEFAULT_SCOPE, num_given: int = 0) -> Req:
        if not prompt_ids:
            raise ValueError("prompt is empty")
        vocab = self.model_config.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        max_new = completion_budget(params.max_tokens, None, len(prompt_ids), self.max_model_len)
        # a prefill-only request holds the prompt (and the outputs given with it) alone: its
        # sequences fork on decode
        demand = (kv_demand(len(prompt_ids) + num_given, 1, 1, self.layout.page_size) if prefill_only
                  else kv_demand(len(prompt_ids), max_new, params.n, self.layout.page_size))
        check_fits(demand, self.kv.capacity)
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise ValueError(f"logit_bias names token {max(params.logit_bias)}, outside the vocabulary "
                             f"[0, {vocab})")
        rid = rid or uuid.uuid4().hex
        if rid in self.requests:
            raise ValueError(f"duplicate request id {rid}")
        if scope.adapter and (self.lora is None or not self.lora.knows(scope.adapter)):
            from .lora.manager import UnknownAdapterError
            raise UnknownAdapterError(f"LoRA adapter {scope.adapter!r} is not loaded here")
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little")
        req = Req(rid=rid, prompt_ids=list(prompt_ids), params=params, max_new_tokens=max_new,
                  seed=seed, prefill_only=prefill_only, scope=scope)
        if params.grammar is not None:
            req.grammar = self.grammars.new_state(params.grammar)  # GrammarError: a ValueError
        if params.prompt_logprobs is not None:
            req.prompt_lps = [None] * len(prompt_ids)
        return req

    def add_request(self, prompt_ids: list[int], params: SamplingParams | None = None,
                    rid: str | None = None, prefill_only: bool = False,
                    output_prefix: list[int] | None = None, scope: CacheScope = DEFAULT_SCOPE,
                    request_group: str = "") -> str:
        """Queue a request. `output_prefix`: tokens already generated elsewhere (decode
        recomputing a prefill whose KV never arrived); they count as output. For n > 1 it
        holds each sequence's first token: they are forked after the prompt, unreported.
        scope: the prefix-cache namespace it reads and fills, and its tenant (cache_scope.py).
        request_group: the client request it came from (the scheduler takes waiting requests
        round robin across groups); "" = its own."""
        params = params or SamplingParams()
        given = len(output_prefix or ()) if params.n == 1 else 0
        req = self._make_req(prompt_ids, params, rid, prefill_only, scope, num_given=given)
        req.request_group = request_group
        if output_prefix and req.params.n > 1:
            req.forced_first = list(output_prefix)
        elif output_prefix:
            self._give_outputs(req, output_prefix)
        self.requests[req.rid] = req
        self.scheduler.add(req)
        return req.rid

    def _give_outputs(self, req: Req, outputs: list[int]) -> None:
        """Output tokens sampled elsewhere join req as its own: max_tokens, penalties, the
        grammar's state and stop strings go on from them, and sampling at their positions."""
        if len(outputs) >= req.max_new_tokens:
            raise ValueError(f"{len(outputs)} output tokens given for max_tokens {req.max_new_tokens}")
        vocab = self.model_config.vocab_size
        if min(outputs) < 0 or max(outputs) >= vocab:
            raise ValueError(f"output token ids must be in [0, {vocab})")
        req.token_ids.extend(outputs)
        req.num_given = len(outputs)
        if req.grammar is not None:
            req.grammar = self.grammars.new_state(req.params.grammar, list(outputs))
        if req.params.stop:  # a stop string across the seam is found from here (_find_stop)
            req.output_text = self.tokenizer.decode(req.output_ids, skip_special_tokens=req.params.skip_special_tokens)

    def reserve(self, reservation_id: str, num_tokens: int, prompt_ids: list[int] | None = None,
                scope: CacheScope = DEFAULT_SCOPE):
        """Decode side: set pages aside for a prompt whose KV another worker will write.
        With the prompt's token ids, the leading pages this worker already holds (any tier,
        under scope's namespace) are reused; the writer fills only the rest. Returns a
        kv_manager.KVReservation (None: no room now). A request of a LoRA adapter also pins a
        device slot with the adapter in it (loading it now, before any KV lands), or waits for one."""
        owner = ("reservation", reservation_id)
        if scope.adapter:
            if self.lora is None or not self.lora.knows(scope.adapter):
                from .lora.manager import UnknownAdapterError
                raise UnknownAdapterError(f"LoRA adapter {scope.adapter!r} is not loaded here")
            if self.lora.acquire(scope.adapter, owner) is None:
                return None
        res = self.kv.reserve(reservation_id, num_tokens, prompt_ids, scope)
        if res is None and self.lora is not None:
            self.lora.release(owner)
        return res

    def cancel_reservation(self, reservation_id: str) -> bool:
        if self.lora is not None:
            self.lora.release(("reservation", reservation_id))
        return self.kv.cancel_reservation(reservation_id)

    def add_prefilled(self, reservation_id: str, prompt_ids: list[int], first_token: int | list[int],
                      params: SamplingParams, seed: int | None, rid: str | None = None,
                      output_prefix: list[int] | None = None, request_group: str = "") -> str:
        """Decode side: join a request whose prompt KV landed in the reserved pages. For
        n > 1, first_token lists every sequence's first token (sampled by prefill): the
        sequences fork from the transferred pages (sequence_group.py). output_prefix: a
        migrated stream's completion tokens so far (n = 1), whose KV landed after the
        prompt's; first_token follows them. request_group: as add_request's."""
        if seed is not None:
            params.seed = seed
        firsts = list(first_token) if isinstance(first_token, (list, tuple)) else [first_token]
        if len(firsts) != params.n:
            raise ValueError(f"{len(firsts)} first tokens for n={params.n}")
        scope = self.kv.reserved[reservation_id].scope  # the namespace its held pages matched under
        if output_prefix and params.n > 1:
            raise ValueError("a migrated stream continues one sequence (n = 1)")
        req = self._make_req(prompt_ids, params, rid, False, scope)
        req.request_group = request_group
        if output_prefix:
            self._give_outputs(req, output_prefix)
        res = self.kv.take_reservation(reservation_id)
        if self.lora is not None:
            req.lora_slot = self.lora.transfer(("reservation", reservation_id), req.rid)
        req.page_ids = res.page_ids
        req.num_tree_pages, req.prefix_node = len(res.held_pages), res.node
        req.num_cached_tokens = len(res.held_pages) * self.layout.page_size
        req.num_host_loaded_tokens = res.host_loaded_pages * self.layout.page_size
        req.kv_load_ticket = res.load_ticket
        req.continues = res.continues
        req.num_computed = len(req.token_ids)
        self.requests[req.rid] = req
        self.scheduler.add_running(req)
        seqs = [req]
        if params.n > 1:
            seqs += self.groups.spawn(req)
            self.groups.place(req, seqs[1:])
        for seq, token in zip(seqs, firsts):
            self._append(seq, token, None, None)  # prefill reported these tokens
        return req.rid

    def is_live(self, rid: str) -> bool:
        """Whether any sequence of request `rid` is still being served."""
        return rid in self.requests or self.groups.is_live(rid)

    def release_held(self, rid: str) -> None:
        """Prefill side: the KV transfer of a held request is done (or failed); free or
        cache its pages."""
        req = self.requests.pop(rid, None)
        if req is not None and req.status is ReqStatus.HELD:
            self.kv.release(req, cache=True)
            self.release_adapter(req)
            req.status = ReqStatus.FINISHED
            self.stats.requests_finished += 1

    def abort(self, rid: str) -> StepOutput | None:
        if self.groups.is_live(rid):  # every sequence of an n > 1 request
            for member in self.groups.members(rid):
                if member in self.requests:
                    self._abort_one(self.requests[member])
            self.groups.live.pop(rid, None)  # sequences waiting in no queue (none expected)
            return StepOutput(rid, [], finished=True, finish_reason="abort", request_finished=True)
        req = self.requests.get(rid)
        if req is None:
            return None
        return self._abort_one(req)

    def _abort_one(self, req: Req, reason: str = "abort") -> StepOutput | None:
        rid = req.rid
        if req.status is ReqStatus.HELD:
            self.release_held(rid)
            return None
        self.scheduler.remove(req)
        req.finish_reason = reason
        self._finish(req)
        return StepOutput(req.out_rid, [], finished=True, finish_reason=reason, index=req.index,
                          request_finished=not self.groups.is_live(req.out_rid))

    def hand_over(self, count: int) -> list[StepOutput]:
        """End up to `count` decoding streams with finish reason "moved", for their callers to
        continue them elsewhere (the busier worker after a role switch spreads its batch, one
        turned prefill gives its streams to the decoders). The youngest first: the fewest output tokens to rebuild there and the
        most still to come. Single-sequence requests only (a sequence of n > 1 shares its
        request's stream with the others)."""
        movable = [r for r in self.requests.values()
                   if r.is_decoding and not r.prefill_only and r.group is None and not self.groups.is_live(r.rid)]
        movable.sort(key=lambda r: (r.num_output, -r.arrival))
        outs = [self._abort_one(r, "moved") for r in movable[:max(0, count)]]
        return [o for o in outs if o is not None]

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or (self.overlap is not None and self.overlap.has_pending_work)

    def get(self, rid: str) -> Req | None:
        return self.requests.get(rid)

    # -- the step -------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        self._stepping = True
        try:
            outs = self._step()
        finally:
            self._stepping = False
        if self.scheduler.failed:
            outs += self._end_failed()
        return outs

    def _step(self) -> list[StepOutput]:
        if self.spec is not None and self.spec.wants_step():
            return self.spec.step()
        if self.overlap is not None:
            return self.overlap.step()
        batch = self.scheduler.schedule()
        if not batch.items:
            return []
        return self._run_batch(batch)

    def _end_failed(self) -> list[StepOutput]:
        """End the requests the scheduler took out of its queue (their LoRA adapter did not load)."""
        outs = []
        for req, why in self.scheduler.failed:
            log.error("request %s: %s", req.rid, why)
            req.finish_reason, req.error = "error", why
            done = self._finish(req)
            outs.append(StepOutput(req.out_rid, [], finished=True, finish_reason="error", error=why, index=req.index,
                                   request_finished=done))
        self.scheduler.failed.clear()
        return outs

    def _run_batch(self, batch) -> list[StepOutput]:
        """Run one scheduled batch on the host-synchronous path."""
        logits = self.runner.forward(batch)
        self.track_kv_written(batch)
        self.stats.steps += 1
        self.count_computed(batch)
        logits = self._take_prompt_logprobs(batch, logits)
        sampling = [it.req for it in batch.items if it.samples]
        return self._sample_and_append(logits, sampling) if sampling else []

    def _take_prompt_logprobs(self, batch, logits):
        """Record prompt logprobs from the rows kept for them (step_plan: all_rows); returns
        the logits of the sampling rows only."""
        if not any(it.all_rows for it in batch.items):
            return logits
        from .prompt_logprobs import record_prompt_logprobs
        return record_prompt_logprobs(batch, logits)

    def _sample_and_append(self, logits, reqs: list[Req]) -> list[StepOutput]:
        """Choose each request's next token and append it (host-synchronous path). A
        request's first sample with n > 1 draws all its sequences' first tokens from its
        row and forks them (sequence_group.py)."""
        seqs, row_of, forks = [], [], []
        for i, req in enumerate(reqs):
            seqs.append(req)
            row_of.append(i)
            if req.params.n > 1 and not req.forked and req.index == 0:
                kids = self.groups.spawn(req)
                forks.append((req, kids))
                seqs += kids
                row_of += [i] * len(kids)
        if len(seqs) > len(reqs):
            logits = logits[torch.tensor(row_of, device=logits.device)]
        forced = {kid.rid: tok for parent, kids in forks if parent.forced_first
                  for kid, tok in zip([parent, *kids], parent.forced_first)}
        rows = [self._sample_row(r) for r in seqs]
        constraints = logit_constraints.prepare(rows, self._grammars, pin=self.device.type == "cuda")
        res = sample(logits, rows, constraints)
        for parent, kids in forks:
            if not parent.prefill_only:
                self.groups.place(parent, kids)
        outs = []
        for j, req in enumerate(seqs):
            if req.rid in forced:  # decode recomputing an n > 1 prefill: already reported
                self._append(req, forced[req.rid], None, None)
                continue
            outs.append(self._append(req, res.token_ids[j], res.logprobs[j] if res.logprobs else None,
                                     res.top_logprobs[j] if res.top_logprobs else None))
            if req.prefill_only and req.index > 0:
                req.status = ReqStatus.FINISHED  # prefill reports it; decode forks it again
        return outs

    def count_computed(self, batch) -> None:
        """Advance each request's computed length and the engine's token counters."""
        for it in batch.items:
            it.req.num_computed = it.end
            # by position: prompt positions are prefill work even when recomputed later
            prompt_part = max(0, min(it.end, it.req.num_prompt) - it.start)
            self.stats.prefill_tokens_computed += prompt_part
            self.stats.decode_tokens_computed += it.length - prompt_part

    # -- when launched work has landed ------------------------------------------------------
    def track_kv_written(self, batch) -> None:
        """After launching a step: its prefill-only chunks' KV counts as ready for a KV
        transfer only once the device has run the step (a step that samples nothing
        returns before the GPU finishes, and with overlap scheduling no step waits)."""
        items = [(it.req, it.end) for it in batch.items if it.req.prefill_only]
        if not items:
            return
        if self.device.type != "cuda":
            for req, end in items:
                req.num_kv_ready = max(req.num_kv_ready, end)
            return
        event = torch.cuda.Event()
        event.record()
        self._kv_in_flight.append((event, items))

    def poll_kv_ready(self) -> None:
        """Move num_kv_ready forward for every step the device has finished."""
        while self._kv_in_flight and self._kv_in_flight[0][0].query():
            _, items = self._kv_in_flight.popleft()
            for req, end in items:
                req.num_kv_ready = max(req.num_kv_ready, end)

    def launched_work_event(self):
        """An event that completes when everything launched so far has run (None on CPU).
        Pages handed to a remote writer (a decode reservation) wait for it: with overlap
        scheduling a step launched before the pages were freed may still write them."""
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def _sample_row(self, req: Req) -> SampleRow:
        suppress = []
        if req.num_output < req.params.min_tokens:
            suppress = self.model_config.eos_token_ids + req.params.stop_token_ids
        return SampleRow(params=req.params, seed=req.seed, position=len(req.token_ids),
                         prompt_ids=req.prompt_ids, output_ids=req.output_ids, suppress_ids=suppress,
                         grammar=req.grammar, logit_bias=req.params.logit_bias)

    def _append(self, req: Req, token: int, lp, top) -> StepOutput:
        first = req.num_output == 0
        first_here = req.num_output == req.num_given  # the first token this worker samples
        if first_here:
            self.stats.cached_tokens += req.num_cached_tokens
            self.stats.host_cached_tokens += req.num_host_loaded_tokens
        req.token_ids.append(token)
        out = StepOutput(req.out_rid, [token], [lp], [top or []], num_prompt_tokens=req.num_prompt,
                         num_cached_tokens=req.num_cached_tokens, index=req.index)
        if first and req.prompt_lps is not None and req.index == 0:
            out.prompt_logprobs = req.prompt_lps
        if req.grammar is not None and not req.grammar.accept(token):
            # cannot happen with the mask applied; never hand out text the grammar rejects
            log.error("request %s: token %d rejected by its grammar; ending it", req.rid, token)
            req.finish_reason, req.error = "error", f"token {token} does not fit the grammar"
            done = True
        else:
            done = self._check_finished(req, token)
        if req.prefill_only and first_here:
            # the KV transfer still reads these pages: hold them until release_held()
            self.scheduler.remove(req)
            self.release_adapter(req)
            req.status = ReqStatus.HELD
            out.prefill_done = True
            if done:
                out.finished, out.finish_reason, out.stop_reason = True, req.finish_reason, req.stop_reason
        elif done:
            self.scheduler.remove(req)
            out.request_finished = self._finish(req)
            out.finished, out.finish_reason, out.stop_reason = True, req.finish_reason, req.stop_reason
            out.error = req.error
            if req.spec is not None:
                out.spec = req.spec.stats
        if req.params.stop:
            out.text = req.output_text
        return out

    def _check_finished(self, req: Req, token: int) -> bool:
        p = req.params
        if req.num_output >= p.min_tokens:
            if not p.ignore_eos and token in self.model_config.eos_token_ids:
                req.finish_reason, req.stop_reason = "stop", None
                return True
            if token in p.stop_token_ids:
                req.finish_reason, req.stop_reason = "stop", token
                return True
            if req.grammar is not None and req.grammar.terminated:  # its stop token was accepted
                req.finish_reason, req.stop_reason = "stop", None
                return True
        if p.stop:
            text = self.tokenizer.decode(req.output_ids, skip_special_tokens=p.skip_special_tokens)
            hit = _find_stop(text, p.stop, len(req.output_text))
            if hit is not None and req.num_output >= p.min_tokens:
                idx, s = hit
                req.output_text = text[:idx]
                req.finish_reason, req.stop_reason = "stop", s
                return True
            req.output_text = text
        if req.num_output >= req.max_new_tokens:
            req.finish_reason = "length"
            return True
        return False

    def release_adapter(self, req: Req) -> None:
        """req no longer runs a forward: its LoRA slot may go to another adapter."""
        if self.lora is not None:
            self.lora.release(req.rid)
            req.lora_slot = -1

    def _finish(self, req: Req) -> bool:
        """Release a finished sequence; True when it was the last of its request."""
        self.kv.release(req, cache=True)
        self.release_adapter(req)
        if self.spec is not None:
            self.spec.release(req)
        req.status = ReqStatus.FINISHED
        self.requests.pop(req.rid, None)
        self.stats.requests_finished += 1
        return self.groups.finished(req)

    # -- accounting -----------------------------------------------------------------------
    @property
    def kv_usage(self) -> float:
        return self.kv.usage_ratio

    def check_idle(self) -> None:
        assert not self.scheduler.has_work and not self.requests, "engine still has requests"
        assert not self.groups.live, f"sequence groups still open: {list(self.groups.live)}"
        if self.lora is not None:
            assert not self.lora.pinned, f"LoRA slots still pinned: {self.lora.owner_slot}"
        self.kv.check_idle()


def _find_stop(text: str, stops: list[str], prev_len: int) -> tuple[int, str] | None:
    """Earliest stop string that ends in the newly added text."""
    best = None
    for s in stops:
        i = text.find(s, max(0, prev_len - len(s) + 1))
        if i != -1 and (best is None or i < best[0]):
            best = (i, s)
    return best
