"""Overlap scheduling: the CPU schedules and prepares step N+1 while the GPU runs step N.

Without it every step ends with the CPU waiting for the sampled tokens (to append them,
check stops, build the next inputs), and the GPU then waits for the CPU. Here a step is
launched without waiting: its sampled tokens go to a device-side ring (`future`) and a
pinned host copy is queued behind them. Each request gets a placeholder id -(slot+1) as
its newest token, so the scheduler sees it as ready to decode and the next step is built
at once; its input id is looked up in the ring on the device (model_runner). Only then
does the CPU wait for step N's tokens, replace the placeholders and run the stop checks
(as SGLang's future-token map and mini-sglang's overlap loop do).

With tensor parallelism every rank resolves placeholders from its own ring: rank 0 sends
the followers the ring slots after the step's plan, and its device writes the sampled
tokens into every rank's ring (peer-mapped memory of the custom all-reduce; an NCCL
broadcast without it; TPWorkers.send_sampled in parallel/launcher.py); a follower's next
forward waits for them on its device, so no rank waits on the host.

Costs: a request that finishes at step N was already scheduled in step N+1; that row's
work is thrown away (its KV writes land in pages it still held; the GPU runs in order,
so a page reused later is written after). Steps whose sampling needs host data (penalties,
logprobs, the first sample of an n > 1 request) wait for the previous step and sample
synchronously. A grammar's mask needs the previous token on the host too: such a step
launches its forward, then takes the previous step's tokens and builds the mask on the
host while the device computes, and samples on the device (SGLang's order)."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from . import logit_constraints
from .request import ReqStatus
from .sampler import draw_key, filter_top_k_top_p_min_p, gumbel_noise


@dataclass
class _Entry:
    req: object  # Req
    index: int  # position in req.token_ids the sampled token belongs at
    placeholder: int | None  # the id standing in for it, or None (nothing appended)


@dataclass
class InFlight:
    entries: list[_Entry]
    host_tokens: torch.Tensor  # [n] int64, filled by a queued device-to-host copy
    done: torch.cuda.Event | None
    batch_no: int = 0  # the scheduler's number of the batch it samples for


class OverlapScheduler:
    def __init__(self, engine):
        self.engine = engine
        self.device = engine.device
        self.capacity = 4 * max(engine.config.max_running_requests, 64)
        car = engine.tp.custom_all_reduce
        ring = car.token_ring(self.capacity) if car is not None else None
        # with the custom all-reduce the ring lives in peer-mapped memory: rank 0 writes
        # every rank's ring on the device (parallel/launcher.py TPWorkers.send_sampled)
        self.pusher = car if ring is not None and engine.tp.size > 1 else None
        self.future = ring if ring is not None else torch.zeros(self.capacity, dtype=torch.int64,
                                                                 device=self.device)
        engine.runner.future_tokens = self.future
        self.cursor = 0
        self.pending: InFlight | None = None
        self.num_sync_steps = 0  # steps that had to sample on the host
        # The newest batch the host has seen finished on the device, and when (perf_counter): a
        # step timer can only measure up to such a point (step_sampler.py); a launch that samples
        # nothing (a chunk mid-prompt) returns without waiting for anything.
        self.settled_batch = 0
        self.settled_at = 0.0

    @property
    def has_pending_work(self) -> bool:
        """A launched step whose tokens some live request still waits for (a flight of
        aborted requests only is not work: its results would all be dropped)."""
        return self.pending is not None and any(
            en.req.status is not ReqStatus.FINISHED for en in self.pending.entries)

    def flush(self):
        """Settle the launched step (tokens appended, stops checked), for a caller that needs
        every request's tokens on the host (a speculative step)."""
        if self.pending is None:
            return []
        outs = self._resolve(self.pending)
        self.pending = None
        return outs

    def step(self):
        e = self.engine
        outs = []
        if self.pending is not None and e.kv.available < len(e.scheduler.running) + 1:
            # pages are short: the scheduler may retract requests; give it true token lists
            outs += self._resolve(self.pending)
            self.pending = None
        batch = e.scheduler.schedule()
        launched = None
        if batch.items:
            launched, now = self._launch(batch)  # may resolve self.pending itself first
            outs += now
            if launched is None:
                return outs
        if self.pending is not None:
            outs += self._resolve(self.pending)
        self.pending = launched
        return outs

    # -- launch --------------------------------------------------------------------------
    def _launch(self, batch):
        e = self.engine
        logits = e.runner.forward(batch)
        e.track_kv_written(batch)
        e.stats.steps += 1
        sampling = [it for it in batch.items if it.samples]
        e.count_computed(batch)
        logits = e._take_prompt_logprobs(batch, logits)
        if not sampling:
            return None, []
        if any(_needs_host(it.req) for it in sampling):
            return None, self._sample_now(logits, sampling)
        early = []
        if self.pending is not None and any(it.req.grammar is not None for it in sampling):
            # the mask follows the previous token: take it now (the forward just launched
            # keeps the device busy meanwhile) and fill the mask before sampling
            early = self._resolve(self.pending)
            self.pending = None
        rows = [e._sample_row(it.req) for it in sampling]
        constraints = logit_constraints.prepare(rows, e._grammars, pin=self.device.type == "cuda")
        tokens = sample_on_device(logits, rows, constraints)
        n = len(sampling)
        if self.cursor + n > self.capacity:
            self.cursor = 0
        start = self.cursor
        self.cursor += n
        if e._tp_workers is not None:  # the other ranks resolve the same placeholders
            if self.pusher is None:
                self.future[start:start + n].copy_(tokens)
            e._tp_workers.send_sampled(start, tokens, self.pusher)
        else:
            self.future[start:start + n].copy_(tokens)
        done = None
        if self.device.type == "cuda":
            host = torch.empty(n, dtype=torch.int64, pin_memory=True)
            host.copy_(tokens, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        else:
            host = tokens
        entries = []
        for i, it in enumerate(sampling):
            req = it.req
            entry = _Entry(req, len(req.token_ids), None)
            if not req.prefill_only:  # prefill-only requests stop after this token
                entry.placeholder = -(start + i + 1)
                req.token_ids.append(entry.placeholder)
            entries.append(entry)
        return InFlight(entries, host, done, e.scheduler.num_batches), early

    def _sample_now(self, logits, sampling):
        """Host-dependent sampling: settle the previous step first, then sample as the
        plain engine does."""
        e = self.engine
        outs = []
        if self.pending is not None:
            outs += self._resolve(self.pending)
            self.pending = None
        self.num_sync_steps += 1
        live = [i for i, it in enumerate(sampling) if it.req.status is not ReqStatus.FINISHED]
        if not live:
            return outs
        reqs = [sampling[i].req for i in live]
        outs += e._sample_and_append(logits[live] if len(live) < len(sampling) else logits, reqs)
        self._settle(e.scheduler.num_batches)  # its tokens were read on the host: the batch is done
        return outs

    def _settle(self, batch_no: int) -> None:
        if batch_no > self.settled_batch:  # the device runs batches in order: all before it are done too
            self.settled_batch, self.settled_at = batch_no, time.perf_counter()

    # -- results -------------------------------------------------------------------------
    def _resolve(self, flight: InFlight):
        e = self.engine
        if flight.done is not None:
            flight.done.synchronize()
        tokens = flight.host_tokens.tolist()
        self._settle(flight.batch_no)
        outs = []
        for entry, tok in zip(flight.entries, tokens):
            req = entry.req
            if req.status is ReqStatus.FINISHED:
                continue  # aborted, or finished one step earlier: this row was spare work
            tail = []
            if entry.placeholder is not None:
                if entry.index >= len(req.token_ids) or req.token_ids[entry.index] != entry.placeholder:
                    continue
                tail = req.token_ids[entry.index + 1:]
                del req.token_ids[entry.index:]
            elif len(req.token_ids) != entry.index:
                continue
            out = e._append(req, tok, None, None)
            if tail and req.status in (ReqStatus.RUNNING, ReqStatus.WAITING):
                req.token_ids.extend(tail)
            outs.append(out)
        return outs


def _to_device(values, dtype, device):
    t = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t


def _needs_host(req) -> bool:
    p = req.params
    return (p.uses_penalties or p.logprobs is not None or req.forced_first is not None
            or (p.n > 1 and not req.forked and req.index == 0))


def sample_on_device(logits: torch.Tensor, rows, constraints=None) -> torch.Tensor:
    """sampler.sample()'s token choice (no penalties, no logprobs) without any host sync:
    returns the [n] int64 tokens on the device."""
    logits = logits.float()
    dev = logits.device
    n, vocab = logits.shape
    sup_rows = [i for i, r in enumerate(rows) for _ in r.suppress_ids]
    edit = logit_constraints.needs_edit(rows, constraints)
    if sup_rows or edit:
        logits = logits.clone()
    if sup_rows:
        sup_ids = [t for r in rows for t in r.suppress_ids]
        logits.index_put_((_to_device(sup_rows, torch.int64, dev), _to_device(sup_ids, torch.int64, dev)),
                          torch.tensor(float("-inf"), device=dev))
    if edit:
        logit_constraints.apply(logits, rows, constraints)
    out = logits.argmax(dim=-1)
    greedy = [r.params.greedy for r in rows]
    if all(greedy):
        return out
    temps = _to_device([max(r.params.temperature, 1e-6) for r in rows], torch.float32, dev)
    scaled = logits / temps[:, None]
    if any(r.params.top_k > 0 or r.params.top_p < 1 or r.params.min_p > 0 for r in rows):
        top_k = _to_device([r.params.top_k if r.params.top_k > 0 else vocab for r in rows], torch.int64, dev)
        top_p = _to_device([r.params.top_p for r in rows], torch.float32, dev)
        min_p = _to_device([r.params.min_p for r in rows], torch.float32, dev)
        scaled = filter_top_k_top_p_min_p(scaled, top_k, top_p, min_p)
    keys = _to_device([draw_key(r.seed, r.position) for r in rows], torch.int64, dev)
    drawn = (scaled.log_softmax(dim=-1) + gumbel_noise(keys, vocab)).argmax(dim=-1)
    return torch.where(_to_device(greedy, torch.bool, dev), out, drawn)
