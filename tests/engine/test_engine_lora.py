"""LoRA adapters in the engine (CPU, float32): random-weight adapters saved by PEFT on the
default model (SmolLM2-135M).

- An adapter of rank 8 on every target module gives exactly transformers' greedy text with PEFT's
  adapter merged into the weights, and not the base model's.
- One batch mixing the base model and two adapters (another rank, other targets) gives each
  request the text it gets alone; so does a single device slot that adapters take in turn (LRU,
  the host cache re-reading an evicted adapter), and nothing stays pinned.
- The prefix cache never shares pages between the base model and an adapter, or two adapters:
  a prompt cached for one is a miss for the others (this fails if the cache key or the page
  hashes ignore the adapter).
- Loading, unloading and unknown adapters; folders PEFT's format allows but the engine does not
  serve are refused, naming why.
- Tensor parallelism (two CPU ranks, a tiny model): each rank's shard of A and B gives TP=1's tokens."""
from __future__ import annotations

import json

import pytest
import torch

from shared.engine.cache_scope import CacheScope
from shared.engine.engine import Engine
from shared.engine.lora.adapter_files import LoraAdapterError
from shared.engine.lora.config import LoraConfig
from shared.engine.lora.manager import UnknownAdapterError
from shared.engine.sampling_params import SamplingParams
from shared.registry.prefix_hashes import chained_page_hashes
from tests.helpers.engine_models import assert_all_pages_free, hf_greedy, load_hf
from tests.helpers.lora_adapters import merged_model, save_random_adapter
from tests.helpers.stack import model_dir as default_model_dir

pytestmark = pytest.mark.usefixtures("torch_one_thread")
KV_BYTES = 24 << 20
TEXTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,"]
MAX_NEW = 12
BASE, A, B = "", "alpha", "beta"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(adapter folders, prompts, {adapter: greedy tokens per prompt}) with transformers' references."""
    from transformers import AutoTokenizer
    root = tmp_path_factory.mktemp("lora")
    base = default_model_dir()
    folders = {A: save_random_adapter(base, root / A, rank=8, seed=1),
               B: save_random_adapter(base, root / B, rank=4, seed=2, targets=("q_proj", "v_proj", "down_proj"))}
    tok = AutoTokenizer.from_pretrained(base)
    prompts = [tok(t).input_ids for t in TEXTS]
    refs = {BASE: [hf_greedy(load_hf(base, torch.float32), p, MAX_NEW) for p in prompts]}
    for name, folder in folders.items():
        model = merged_model(base, folder)
        refs[name] = [hf_greedy(model, p, MAX_NEW) for p in prompts]
    return folders, prompts, refs


def _engine(folders, names=(A, B), **lora) -> Engine:
    cfg = LoraConfig(adapters=[f"{n}={folders[n]}" for n in names], **lora)
    return Engine(device="cpu", kv_cache_memory=KV_BYTES, lora=cfg)


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_NEW)


def _run(eng: Engine, jobs: list[tuple[list[int], str]]) -> list[tuple[list[int], int]]:
    """Every (prompt, adapter) at once, stepped to the end: (tokens, cached prompt tokens) each."""
    rids = [eng.add_request(p, _greedy(), scope=CacheScope(adapter=a)) for p, a in jobs]
    out = {rid: ([], 0) for rid in rids}
    while eng.has_work:
        for o in eng.step():
            assert o.error is None, o.error
            out[o.rid][0].extend(o.token_ids)
            out[o.rid] = (out[o.rid][0], o.num_cached_tokens)
    return [out[r] for r in rids]


def test_an_adapter_gives_transformers_peft_merged_greedy_text(served):
    folders, prompts, refs = served
    assert all(refs[A][i] != refs[BASE][i] for i in range(len(prompts)))  # the adapter changes the text
    eng = _engine(folders, names=(A,))
    assert eng.plan.lora.shown == "4x16" and eng.lora.names == [A]
    for i, prompt in enumerate(prompts):
        (tokens, _), = _run(eng, [(prompt, A)])
        assert tokens == refs[A][i], TEXTS[i]
    assert eng.lora.resident == [A]
    assert_all_pages_free(eng)


@pytest.mark.parametrize("slots", [4, 1])
def test_a_batch_mixing_base_and_two_adapters_gives_each_request_its_own_text(served, slots):
    """slots=1: the adapters take the one device slot in turn (requests wait for it as for pages),
    and with one host copy an adapter evicted from both is read from its folder again."""
    folders, prompts, refs = served
    eng = _engine(folders, max_loras=slots, max_cpu_loras=slots)
    jobs = [(p, name) for name in (A, BASE, B) for p in prompts]
    got = _run(eng, jobs)
    for (prompt, name), (tokens, _) in zip(jobs, got):
        assert tokens == refs[name][prompts.index(prompt)], (name, TEXTS[prompts.index(prompt)])
    assert eng.lora.pinned == 0
    assert len(eng.lora.host) <= slots
    assert_all_pages_free(eng)


def test_prefix_pages_are_never_shared_across_adapters(served):
    folders, prompts, refs = served
    eng = _engine(folders)
    ps = eng.layout.page_size
    prompt = prompts[2] * 5  # several full pages
    assert len(prompt) >= 3 * ps
    cached = {name: _run(eng, [(prompt, name)])[0] for name in (BASE, A, B)}
    assert all(c == 0 for _, c in cached.values()), "a page was shared across adapters"
    for name in (BASE, A, B):  # each hits its own pages the second time
        tokens, hit = _run(eng, [(prompt, name)])[0]
        assert tokens == cached[name][0] and hit >= (len(prompt) // ps - 1) * ps, name
    # the key and the hashes the registry publishes differ per adapter, within one namespace
    scopes = [CacheScope(namespace=7, adapter=n) for n in (BASE, A, B)]
    assert scopes[0].cache_key == 7 and len({s.cache_key for s in scopes}) == 3
    assert len({tuple(chained_page_hashes(prompt, ps, seed=s.cache_key)) for s in scopes}) == 3
    assert_all_pages_free(eng)


def test_n_sequences_and_sampling_run_with_the_adapter(served):
    """n > 1 forks share the parent's slot; a seeded sample is reproducible under the adapter."""
    folders, prompts, refs = served
    eng = _engine(folders)
    params = SamplingParams(temperature=0.8, seed=5, n=3, max_tokens=6)
    runs = []
    for _ in range(2):
        rid = eng.add_request(prompts[0], params, scope=CacheScope(adapter=A))
        seqs: dict[int, list[int]] = {}
        while eng.has_work:
            for o in eng.step():
                if o.rid == rid:
                    seqs.setdefault(o.index, []).extend(o.token_ids)
        runs.append(seqs)
    assert runs[0] == runs[1] and len(runs[0]) == 3
    assert eng.lora.pinned == 0
    assert_all_pages_free(eng)


def test_loading_unloading_and_unknown_adapters(served, tmp_path):
    folders, prompts, refs = served
    eng = _engine(folders, names=(), max_loras=2)
    with pytest.raises(UnknownAdapterError, match="'alpha' is not loaded"):
        eng.add_request(prompts[0], _greedy(), scope=CacheScope(adapter=A))
    eng.lora.load(A, str(folders[A]))
    with pytest.raises(LoraAdapterError, match="loaded already"):
        eng.lora.load(A, str(folders[A]))
    (tokens, _), = _run(eng, [(prompts[1], A)])
    assert tokens == refs[A][1]
    assert eng.lora.unload(A) and not eng.lora.unload(A)
    assert eng.lora.resident == [] and eng.lora.names == []
    with pytest.raises(UnknownAdapterError):
        eng.add_request(prompts[0], _greedy(), scope=CacheScope(adapter=A))
    plain = Engine(device="cpu", kv_cache_memory=KV_BYTES)
    assert plain.lora is None and plain.plan.lora.shown == "off"
    with pytest.raises(UnknownAdapterError):
        plain.add_request(prompts[0], _greedy(), scope=CacheScope(adapter=A))


def _copy_adapter(src, dst, config_edit=None, tensors_edit=None):
    from safetensors.torch import load_file, save_file
    dst.mkdir()
    conf = json.loads((src / "adapter_config.json").read_text())
    if config_edit:
        config_edit(conf)
    (dst / "adapter_config.json").write_text(json.dumps(conf))
    tensors = load_file(str(src / "adapter_model.safetensors"))
    if tensors_edit:
        tensors_edit(tensors)
    save_file(tensors, str(dst / "adapter_model.safetensors"))
    return dst


def test_folders_the_engine_does_not_serve_are_refused_by_name(served, tmp_path):
    folders, _, _ = served
    eng = _engine(folders, names=(), max_loras=1, max_lora_rank=4)
    src = folders[A]
    cases = {
        "no adapter_config.json": tmp_path / "empty",
        "rank 8 is above --max-lora-rank 4": src,
        "DoRA adapters are not served": _copy_adapter(src, tmp_path / "dora", lambda c: c.update(use_dora=True, r=4)),
        "trained biases": _copy_adapter(src, tmp_path / "bias", lambda c: c.update(bias="all", r=4)),
        "modules_to_save": _copy_adapter(src, tmp_path / "mts", lambda c: c.update(modules_to_save=["lm_head"],
                                                                                    r=4)),
        "is not a LoRA weight": _copy_adapter(
            folders[B], tmp_path / "embed",
            tensors_edit=lambda t: t.update({"base_model.model.model.embed_tokens.lora_embedding_A":
                                             torch.zeros(4, 8)})),
        r"must be \(4, 1536\) and \(576, 4\)": _copy_adapter(src, tmp_path / "shape", lambda c: c.update(r=4)),
    }
    (tmp_path / "empty").mkdir()
    for why, folder in cases.items():
        with pytest.raises(LoraAdapterError, match=why):
            eng.lora.load("x", str(folder))
    assert eng.lora.names == []
    with pytest.raises(ValueError, match="NAME=PATH"):
        LoraConfig(adapters=["no-path"])
    with pytest.raises(ValueError, match="must be 1-128 characters"):
        LoraConfig(adapters=["bad name=/x"])


def test_tensor_parallel_ranks_hold_their_shard_of_each_adapter(tmp_path):
    """TP=2 on the CPU (gloo): q/k/v and gate/up adapters split by output rows, o and down by
    input columns (their partial updates summed by the all-reduce): TP=1's tokens, which are
    transformers' with the adapter merged (float64)."""
    from tests.helpers.tiny_models import make_tiny_model
    base = make_tiny_model(tmp_path / "tiny", "qwen3", vocab=251, heads=4, kv_heads=2)
    adapter = save_random_adapter(base, tmp_path / "ad", rank=8, seed=3)
    prompts = [[5, 6, 7, 8, 9] * 5, list(range(20, 44))]
    model = merged_model(base, adapter, torch.float64)
    want = [hf_greedy(model, p, 8, eos_token_id=None) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    cfg = LoraConfig(adapters=[f"ad={adapter}"])
    for tp in (1, 2):
        eng = Engine(model_dir=str(base), dtype="float64", device="cpu", num_threads=1, kv_cache_memory=8 << 20,
                     lora=cfg, tp=tp)
        try:
            got = [_run_params(eng, p, params, "ad") for p in prompts]
            assert got == want, f"tp={tp}"
            eng.check_idle()
        finally:
            eng.close()


def _run_params(eng, prompt, params, adapter):
    rid = eng.add_request(prompt, params, scope=CacheScope(adapter=adapter))
    tokens = []
    while eng.has_work:
        for o in eng.step():
            if o.rid == rid:
                tokens += o.token_ids
    return tokens


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU: the Triton kernels inside CUDA graphs")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_on_a_gpu_the_graphs_replay_each_rows_adapter(tmp_path, dtype):
    """Decode and small-prefill CUDA graphs captured once (every row on the base model) replay the
    Triton LoRA kernels with each step's slots: the tokens of eager steps, mixed as alone; in
    float32 also the CPU's (the torch references)."""
    from tests.helpers.tiny_models import make_tiny_model
    base = make_tiny_model(tmp_path / "tiny", "llama", hidden=256, intermediate=512, heads=4, kv_heads=2,
                           head_dim=64, vocab=512)
    folders = {"a": save_random_adapter(base, tmp_path / "a", rank=8, seed=1),
               "b": save_random_adapter(base, tmp_path / "b", rank=16, seed=2, targets=("q_proj", "down_proj"))}
    cfg = LoraConfig(adapters=[f"{n}={f}" for n, f in folders.items()], max_loras=2)
    jobs = [([5 + i, 6, 7, 8, 9 + i] * (2 + i), ["", "a", "b"][i % 3]) for i in range(6)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)

    def serve(**kw):
        eng = Engine(model_dir=str(base), dtype=dtype, kv_cache_memory=64 << 20, max_model_len=512, lora=cfg, **kw)
        rids = [eng.add_request(p, params, scope=CacheScope(adapter=a)) for p, a in jobs]
        out = {r: [] for r in rids}
        while eng.has_work:
            for o in eng.step():
                out[o.rid] += o.token_ids
        mixed = [out[r] for r in rids]
        alone = [_run_params(eng, p, params, a) for p, a in jobs]
        eng.check_idle()
        return mixed, alone

    graphs, graphs_alone = serve(device="cuda")
    eager, _ = serve(device="cuda", cuda_graph=False, prefill_graph_max_tokens=0)
    assert graphs == graphs_alone == eager
    if dtype == "float32":
        assert serve(device="cpu")[0] == graphs
