"""Speculative decoding in the engine: n-gram lookup on a copy task with the
embedded model, and exactness under every request feature with a scripted proposer that
drafts the true continuation with planted mistakes, so acceptance and rejection happen at
known places. Greedy and seeded sampling must give the same tokens and logprobs as the
plain engine; stops, max_tokens, min_tokens, penalties, logit_bias, grammars and n > 1
behave as without speculation; pages all come back; rejected tokens never reach the
prefix cache."""
from __future__ import annotations

import json

import pytest
import torch

from shared.engine.engine import Engine
from shared.engine.grammar_spec import GrammarSpec
from shared.engine.sampling_params import SamplingParams
from shared.engine.speculative.ngram import NgramIndex
from shared.engine.speculative.state import Draft
from tests.helpers.engine_models import assert_all_pages_free, build_model_dir, random_prompts, run_engine

KIND = "llama_tied_gqa2"
PAGE = 4
KV = 8 << 20

pytestmark = pytest.mark.usefixtures("torch_one_thread")


# -- n-gram index ----------------------------------------------------------------------------
def test_ngram_longest_latest_match_and_periodic_continuation():
    idx = NgramIndex(min_n=1, max_n=3)
    # "5 6 7" occurs twice before the suffix; the latest occurrence proposes what followed it
    toks = [5, 6, 7, 1, 5, 6, 7, 2, 9, 5, 6, 7]
    assert idx.propose(toks, 3) == [2, 9, 5]
    # a run shorter than k continues from the proposal itself (periodic text)
    idx = NgramIndex(min_n=2, max_n=2)
    assert idx.propose([3, 4, 3, 4], 5) == [3, 4, 3, 4, 3]
    # nothing repeated: no draft; below min_n: no draft
    assert NgramIndex(2, 4).propose([1, 2, 3, 4, 5], 4) == []
    assert NgramIndex(2, 4).propose([1, 2, 9, 2], 4) == []
    # the index grows with the tokens: a later call sees the new n-grams
    idx = NgramIndex(1, 2)
    toks = [1, 2, 3]
    assert idx.propose(toks, 2) == []
    toks += [1, 2]
    assert idx.propose(toks, 2) == [3, 1]


# -- a scripted proposer ---------------------------------------------------------------------
class Scripted:
    """Drafts the true continuation (from a plain run), wrong at `bad_at` every other call."""
    name = "scripted"

    def __init__(self, truth: dict, vocab: int, bad_at: int | None = 1):
        self.truth, self.vocab, self.bad_at, self.calls = truth, vocab, bad_at, 0

    def propose(self, reqs, ks):
        out = []
        for req, k in zip(reqs, ks):
            truth = self.truth.get((req.out_rid, req.index)) or self.truth[tuple(req.prompt_ids)]
            seq = truth[req.num_output:req.num_output + k]
            self.calls += 1
            if self.bad_at is not None and self.calls % 2 and len(seq) > self.bad_at:
                seq = list(seq)
                seq[self.bad_at] = (seq[self.bad_at] + 1) % self.vocab
            out.append(Draft(list(seq)))
        return out

    def release(self, req):
        pass


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tests.helpers.stack import model_dir as default_model_dir
    return build_model_dir(tmp_path_factory.mktemp("spec") / KIND, KIND, seed=7,
                           tokenizer_from=default_model_dir())


def make(d, spec: bool, **kw) -> Engine:
    opts = dict(model_dir=str(d), dtype="float64", device="cpu", page_size=PAGE, kv_cache_memory=KV,
                max_num_batched_tokens=64)
    if spec:
        opts.update(speculative_method="ngram", speculative_tokens=4, speculative_min_acceptance=0.0)
    opts.update(kw)
    return Engine(**opts)


@pytest.fixture(scope="module")
def plain(model_dir):
    return make(model_dir, False)


@pytest.fixture(scope="module")
def spec(model_dir):
    return make(model_dir, True)


PROMPTS = random_prompts(5, [7, 12, 5, 20, 9], seed=3)


def scripted_run(spec_eng, plain_eng, prompts, params, bad_at=1, k=4):
    base = run_engine(plain_eng, prompts, params, rids=[f"r{i}" for i in range(len(prompts))])
    truth = {}
    for i, res in enumerate(base):
        truth[(f"r{i}", 0)] = res.token_ids
    spec_eng.spec.k = k
    spec_eng.spec.proposer = Scripted(truth, spec_eng.model_config.vocab_size, bad_at)
    before = spec_eng.spec.stats.verify_steps
    got = run_engine(spec_eng, prompts, params, rids=[f"r{i}" for i in range(len(prompts))])
    assert spec_eng.spec.stats.verify_steps > before, "nothing was verified"
    assert_all_pages_free(spec_eng)
    return base, got


def same(base, got, logprobs=False):
    for b, g in zip(base, got):
        assert g.token_ids == b.token_ids
        assert g.finish_reason == b.finish_reason and g.stop_reason == b.stop_reason
        assert g.text == b.text
        if logprobs:
            assert g.logprobs == pytest.approx(b.logprobs, abs=1e-9)
            for tb, tg in zip(b.top_logprobs, g.top_logprobs):
                assert [t for t, _ in tg] == [t for t, _ in tb]
                assert [v for _, v in tg] == pytest.approx([v for _, v in tb], abs=1e-9)


CASES = {
    "greedy": dict(temperature=0.0, max_tokens=24, ignore_eos=True),
    "seeded": dict(temperature=1.0, seed=11, max_tokens=24, ignore_eos=True),
    "filters": dict(temperature=0.8, top_k=20, top_p=0.9, min_p=0.02, seed=5, max_tokens=20, ignore_eos=True),
    "penalties": dict(temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.4,
                      max_tokens=24, ignore_eos=True),
    "sampled_penalties": dict(temperature=1.0, seed=2, frequency_penalty=1.0, max_tokens=20, ignore_eos=True),
    "logit_bias": dict(temperature=0.0, logit_bias={17: 5.0, 18: 4.0, 40: -100.0}, max_tokens=20, ignore_eos=True),
    "logprobs": dict(temperature=0.7, seed=9, logprobs=3, max_tokens=16, ignore_eos=True),
    "min_tokens": dict(temperature=0.0, min_tokens=10, max_tokens=18, stop_token_ids=[]),
    "stop_ids": dict(temperature=1.0, seed=4, max_tokens=30, ignore_eos=True, stop_token_ids=[30, 31, 32, 33]),
    "stop_strings": dict(temperature=1.0, seed=8, max_tokens=30, ignore_eos=True, stop=["e", "a"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_scripted_drafts_give_the_plain_output(spec, plain, case):
    base, got = scripted_run(spec, plain, PROMPTS, SamplingParams(**CASES[case]))
    same(base, got, logprobs=case == "logprobs")


@pytest.mark.parametrize("bad_at", [None, 0, 3])
def test_every_acceptance_pattern(spec, plain, bad_at):
    params = SamplingParams(temperature=1.0, seed=21, max_tokens=17, ignore_eos=True)
    base, got = scripted_run(spec, plain, PROMPTS, params, bad_at=bad_at, k=5)
    same(base, got)


def test_max_tokens_never_overshoots(spec, plain):
    # k=7 drafts against max_tokens that end mid-draft
    for n in (3, 4, 6, 9):  # (2: the one token after the first leaves no room for a draft)
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        base, got = scripted_run(spec, plain, PROMPTS[:2], params, bad_at=None, k=7)
        same(base, got)
        assert all(len(g.token_ids) == n for g in got)


def test_grammar(spec, plain):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "yy"]}},
              "required": ["a", "b"], "additionalProperties": False}
    for temp in (0.0, 1.0):
        params = SamplingParams(temperature=temp, seed=3, max_tokens=40,
                                grammar=GrammarSpec("json_schema", json.dumps(schema)))
        base, got = scripted_run(spec, plain, PROMPTS[:3], params, bad_at=2)
        same(base, got)
        for g in got:
            if g.finish_reason == "stop":
                json.loads(spec.tokenizer.decode(g.token_ids, skip_special_tokens=True))


def test_n_greater_than_one(spec, plain):
    params = SamplingParams(temperature=1.0, seed=13, n=3, max_tokens=12, ignore_eos=True)
    rids = ["a", "b"]

    def by_index(eng):
        got = {}
        for rid, p in zip(rids, PROMPTS[:2]):
            eng.add_request(p, params, rid=rid)
        while eng.has_work:
            for out in eng.step():
                got.setdefault((out.rid, out.index), []).extend(out.token_ids)
        return got
    truth = by_index(plain)
    spec.spec.proposer = Scripted(truth, spec.model_config.vocab_size, 1)
    before = spec.spec.stats.verify_steps
    assert by_index(spec) == truth
    assert spec.spec.stats.verify_steps > before
    assert_all_pages_free(spec)


def test_overlap_off_and_retraction(model_dir, plain):
    """The plain loop, and a pool so small that requests are retracted and recomputed."""
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=20, ignore_eos=True)
    tiny = make(model_dir, True, overlap_schedule=False, kv_cache_memory=None, page_size=PAGE)
    from tests.helpers.engine_models import kv_bytes_for_pages
    small = make(model_dir, True, kv_cache_memory=kv_bytes_for_pages(model_dir, 22, PAGE))
    for eng in (tiny, small):
        base, got = scripted_run(eng, plain, PROMPTS, params, bad_at=2)
        same(base, got)
    assert small.scheduler.num_retracted > 0


def test_rejected_tokens_never_cached(model_dir, plain):
    """Every draft is wrong from its second token on: the tree caches exactly the output."""
    eng = make(model_dir, True)
    params = SamplingParams(temperature=0.0, max_tokens=23, ignore_eos=True)
    base, got = scripted_run(eng, plain, [PROMPTS[3]], params, bad_at=1)
    same(base, got)
    seq = PROMPTS[3] + got[0].token_ids
    m = eng.kv.cache.match(seq)
    full = (len(seq) - 1) // PAGE  # the last token's KV is never computed
    assert len(m.pages) == full
    # and nothing else: a lookup with a rejected draft token in the middle matches less
    wrong = list(seq)
    wrong[len(PROMPTS[3]) + 6] = (wrong[len(PROMPTS[3]) + 6] + 1) % 512
    assert len(eng.kv.cache.match(wrong).pages) <= (len(PROMPTS[3]) + 6) // PAGE


def test_steps_aside_above_max_batch_and_at_low_acceptance(model_dir, plain):
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    eng = make(model_dir, True, speculative_max_batch=2)
    base, _ = scripted_run(eng, plain, PROMPTS[:2], params, bad_at=None)
    steps = eng.spec.stats.verify_steps
    eng.spec.proposer.calls = 0
    got = run_engine(eng, PROMPTS, params, rids=[f"r{i}" for i in range(5)])  # 5 > 2 decoding
    assert eng.spec.stats.verify_steps == steps and eng.spec.stats.stepped_aside > 0
    # always wrong at token 0: acceptance 0, the requests sit out
    eng = make(model_dir, True, speculative_min_acceptance=0.5)
    base = run_engine(plain, PROMPTS[:2], params, rids=["r0", "r1"])
    truth = {(f"r{i}", 0): [(t + 1) % 512 for t in b.token_ids] for i, b in enumerate(base)}
    eng.spec.proposer = Scripted(truth, 512, None)
    got = run_engine(eng, PROMPTS[:2], params, rids=["r0", "r1"])
    same(base, got)
    assert eng.spec.stats.accepted_tokens == 0
    assert eng.spec.stats.verify_steps <= 2 * 3  # a few tries each, then the cool-down
    assert_all_pages_free(eng)


# -- draft models ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def draft_dir(model_dir, tmp_path_factory):
    """The target with noise on every weight: proposes like it, often but not always."""
    import shutil
    from safetensors.torch import load_file, save_file
    d = tmp_path_factory.mktemp("draft") / "noisy"
    shutil.copytree(model_dir, d)
    g = torch.Generator().manual_seed(3)
    weights = load_file(str(d / "model.safetensors"))
    save_file({k: v + 0.15 * v.std() * torch.randn(v.shape, generator=g, dtype=v.dtype) if v.dim() > 1 else v
               for k, v in weights.items()}, str(d / "model.safetensors"), metadata={"format": "pt"})
    return d


@pytest.fixture(scope="module")
def other_arch_dir(tmp_path_factory):
    """A draft of another architecture with the same vocabulary."""
    from tests.helpers.stack import model_dir as default_model_dir
    return build_model_dir(tmp_path_factory.mktemp("draft2") / "qwen2_tied", "qwen2_tied", seed=8,
                           tokenizer_from=default_model_dir())


def draft_engine(model_dir, draft_dir, **kw):
    return make(model_dir, True, speculative_method="draft", speculative_draft_model=str(draft_dir), **kw)


@pytest.mark.parametrize("which", ["noisy", "other_arch"])
def test_draft_model_gives_the_plain_output(model_dir, draft_dir, other_arch_dir, plain, which):
    eng = draft_engine(model_dir, draft_dir if which == "noisy" else other_arch_dir,
                       max_num_batched_tokens=16)  # catch-up in chunks
    prompts = PROMPTS + [random_prompts(1, [40], seed=9)[0]]
    for params in (SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
                   SamplingParams(temperature=0.0, max_tokens=20, logprobs=2, repetition_penalty=1.2,
                                  ignore_eos=True)):
        base = run_engine(plain, prompts, params)
        got = run_engine(eng, prompts, params)
        same(base, got, logprobs=params.logprobs is not None)
    st = eng.spec.stats
    assert st.verify_steps > 0 and st.accepted_tokens < st.draft_tokens
    if which == "noisy":
        assert st.accepted_tokens > 0
    assert_all_pages_free(eng)
    assert eng.spec.proposer.kv.pages_in_use == 0


def test_embedded_model_as_its_own_draft_accepts_every_token():
    from shared.model_files.default_model import ensure_default_model
    d = str(ensure_default_model(progress=False))
    base = Engine(kv_cache_memory=64 << 20)
    eng = Engine(kv_cache_memory=128 << 20, speculative_method="draft", speculative_draft_model=d,
                 speculative_tokens=4)
    tok = base.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True,
                                       tokenize=True, return_dict=False)
               for c in ("Name three colours.", "Write a haiku about rain.")]
    params = SamplingParams(temperature=0.0, max_tokens=24)
    assert [r.token_ids for r in run_engine(eng, prompts, params)] == \
        [r.token_ids for r in run_engine(base, prompts, params)]
    # sampling: p == q, so every draft passes the test too
    run_engine(eng, prompts, SamplingParams(temperature=1.0, seed=5, max_tokens=24))
    st = eng.spec.stats
    assert st.draft_tokens > 20 and st.accepted_tokens == st.draft_tokens
    assert st.acceptance_by_position == [1.0] * 4
    assert_all_pages_free(eng)


def test_rejection_sampling_keeps_the_target_distribution(model_dir, draft_dir):
    """Sampled drafts from a different model, top-k 3 at temperature 1: the pair (first
    token, first verified token) follows the target's exact joint distribution."""
    from tests.helpers.engine_models import hf_logits, load_hf
    eng = draft_engine(model_dir, draft_dir, speculative_tokens=1, max_running_requests=512,
                       speculative_max_batch=512, max_num_batched_tokens=8192, kv_cache_memory=64 << 20)
    prompt = PROMPTS[1]
    n = 1500
    params = [SamplingParams(temperature=1.0, top_k=3, seed=1000 + i, max_tokens=3, ignore_eos=True)
              for i in range(n)]
    got = run_engine(eng, [prompt] * n, params)
    st = eng.spec.stats
    assert st.verify_steps >= n * 0.9 and 0 < st.accepted_tokens < st.draft_tokens
    hf = load_hf(model_dir, torch.float64)

    def top3(logits):
        v, i = logits.topk(3)
        return dict(zip(i.tolist(), v.softmax(-1).tolist()))
    first = top3(hf_logits(hf, prompt)[-1])
    expected = {(a, b): pa * pb for a, pa in first.items()
                for b, pb in top3(hf_logits(hf, prompt + [a])[-1]).items()}
    from collections import Counter
    seen = Counter((r.token_ids[0], r.token_ids[1]) for r in got)
    assert set(seen) <= set(expected)
    chi2 = sum((seen.get(c, 0) - n * p) ** 2 / (n * p) for c, p in expected.items())
    assert chi2 < 26.1, (chi2, seen, expected)  # 8 degrees of freedom: p = 0.001
    assert_all_pages_free(eng)


# -- EAGLE-3 ---------------------------------------------------------------------------------
def build_eagle_head(path, vocab=512, hidden=64, target_hidden=64, draft_vocab=96, seed=0, own_embed=False):
    """A random EAGLE-3 head in the public format (config.json + safetensors, d2t/t2d)."""
    from safetensors.torch import save_file
    path.mkdir(parents=True, exist_ok=True)
    heads, kv, hd, inter = 4, 2, 16, 128
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": hidden,
           "intermediate_size": inter, "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": hd,
           "num_hidden_layers": 1, "vocab_size": vocab, "draft_vocab_size": draft_vocab, "rms_norm_eps": 1e-6,
           "max_position_embeddings": 512, "rope_theta": 10000.0, "tie_word_embeddings": False,
           "target_hidden_size": target_hidden,
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 0, 1]}}
    (path / "config.json").write_text(json.dumps(cfg))
    g = torch.Generator().manual_seed(seed)

    def w(*shape, scale=0.3):
        return torch.randn(*shape, generator=g) * scale
    hot = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values
    t = {"fc.weight": w(hidden, 3 * target_hidden), "norm.weight": 1 + w(hidden, scale=0.1),
         "midlayer.input_layernorm.weight": 1 + w(hidden, scale=0.1),
         "midlayer.hidden_norm.weight": 1 + w(hidden, scale=0.1),
         "midlayer.post_attention_layernorm.weight": 1 + w(hidden, scale=0.1),
         "midlayer.self_attn.q_proj.weight": w(heads * hd, 2 * hidden),
         "midlayer.self_attn.k_proj.weight": w(kv * hd, 2 * hidden),
         "midlayer.self_attn.v_proj.weight": w(kv * hd, 2 * hidden),
         "midlayer.self_attn.o_proj.weight": w(hidden, heads * hd),
         "midlayer.mlp.gate_proj.weight": w(inter, hidden), "midlayer.mlp.up_proj.weight": w(inter, hidden),
         "midlayer.mlp.down_proj.weight": w(hidden, inter), "lm_head.weight": w(draft_vocab, hidden),
         "d2t": hot - torch.arange(draft_vocab), "t2d": torch.zeros(vocab, dtype=torch.bool).index_fill_(0, hot, True)}
    if own_embed:
        t["embed_tokens.weight"] = w(vocab, hidden)
    save_file({k: v.contiguous() for k, v in t.items()}, str(path / "model.safetensors"))
    return path, hot


@pytest.mark.parametrize("own_embed", [False, True])
def test_eagle3_head_gives_the_plain_output(model_dir, plain, tmp_path, own_embed):
    head, hot = build_eagle_head(tmp_path / "eagle", own_embed=own_embed)
    eng = make(model_dir, True, speculative_method="eagle3", speculative_draft_model=str(head))
    assert eng.model.aux_capture is not None and eng.model.aux_capture.layers == [1, 1, 2]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    same(run_engine(plain, PROMPTS, params), run_engine(eng, PROMPTS, params))
    # sampling: drafts drawn from the head, verified by rejection sampling (distribution-exact,
    # test_rejection_sampling_keeps_the_target_distribution; not token-identical)
    got = run_engine(eng, PROMPTS, SamplingParams(temperature=1.0, seed=3, max_tokens=20, ignore_eos=True))
    assert all(len(g.token_ids) == 20 and g.finish_reason == "length" for g in got)
    st = eng.spec.stats
    assert st.verify_steps > 0 and st.draft_tokens > 0
    assert_all_pages_free(eng)
    assert eng.spec.proposer.kv.pages_in_use == 0


def test_eagle3_drafts_come_from_the_hot_vocabulary(model_dir, tmp_path):
    head, hot = build_eagle_head(tmp_path / "eagle")
    eng = make(model_dir, True, speculative_method="eagle3", speculative_draft_model=str(head))
    seen = []
    real = eng.spec.proposer.propose

    def spy(reqs, ks):
        out = real(reqs, ks)
        seen.extend(t for d in out for t in d.tokens)
        return out
    eng.spec.proposer.propose = spy
    run_engine(eng, PROMPTS[:2], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    assert seen and set(seen) <= set(hot.tolist())
    # the head's logits live on its draft vocabulary only
    logits, _ = eng.spec.proposer.model.compute_logits(torch.zeros(1, 128, dtype=torch.float64))
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == hot.tolist()


# -- disaggregated: the decode engine speculates, the prefill engine does not ------------------
def split_run(pre: Engine, dec: Engine, prompt, params: SamplingParams) -> list[int]:
    """Prefill on `pre`, copy the KV into a reservation on `dec`, decode there."""
    from shared.engine.request import ReqStatus
    rid = pre.add_request(prompt, params, prefill_only=True)
    first = None
    while pre.has_work:
        for out in pre.step():
            assert out.prefill_done
            first = out
    held = pre.get(rid)
    assert held.status is ReqStatus.HELD
    n = pre.kv.pages_for(len(prompt))
    dst = dec.reserve("res", len(prompt)).page_ids
    dec.pool.buffer[dst] = pre.pool.buffer[held.page_ids[:n]]
    pre.release_held(rid)
    got = list(first.token_ids)
    dec.add_prefilled("res", prompt, first.token_ids[0], SamplingParams(**vars(params)), seed=None)
    while dec.has_work:
        for out in dec.step():
            got.extend(out.token_ids)
    return got


@pytest.mark.parametrize("method", ["ngram", "draft", "eagle3"])
def test_split_decode_speculates_with_a_plain_prefill(model_dir, draft_dir, plain, tmp_path, method):
    """The decode side makes what its draft needs (the draft's KV of the prompt, the head's
    features from its first step); the answer is the colocated plain one."""
    extra = {"ngram": {}, "draft": dict(speculative_draft_model=str(draft_dir)),
             "eagle3": dict(speculative_draft_model=str(build_eagle_head(tmp_path / "eagle")[0]))}[method]
    dec = make(model_dir, True, speculative_method=method, **extra)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    bases = [r.token_ids for r in run_engine(plain, PROMPTS[:3], params)]
    if method == "ngram":  # random weights rarely repeat themselves: draft the truth, with mistakes
        dec.spec.proposer = Scripted({tuple(p): b for p, b in zip(PROMPTS, bases)}, 512, 1)
    for prompt, base in zip(PROMPTS[:3], bases):
        assert split_run(make(model_dir, False), dec, prompt, params) == base
        assert_all_pages_free(dec)
    assert dec.spec.stats.verify_steps > 0


def test_ngram_on_a_copy_request_with_the_embedded_model():
    """The real proposer on the task it is for: the copy comes out as without speculation,
    with several tokens accepted per verify step."""
    from shared.model_files.default_model import ensure_default_model
    d = str(ensure_default_model(progress=False))
    base = Engine(model_dir=d, kv_cache_memory=64 << 20)
    eng = Engine(model_dir=d, kv_cache_memory=64 << 20, speculative_method="ngram", speculative_tokens=4)
    para = ("The quick brown fox jumps over the lazy dog near the river bank, while the farmer watches "
            "from his old wooden porch and sips a cup of hot coffee in the cold morning air.")
    ids = base.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Repeat this paragraph exactly, word for word:\n\n" + para}],
        add_generation_prompt=True, tokenize=True, return_dict=False)
    for params in (SamplingParams(temperature=0.0, max_tokens=60),
                   SamplingParams(temperature=0.8, seed=4, max_tokens=60)):  # point masses: same tokens
        assert run_engine(eng, [ids], params)[0].token_ids == run_engine(base, [ids], params)[0].token_ids
    st = eng.spec.stats
    assert st.verify_steps > 0 and st.mean_accepted_length >= 3.0, st
    assert_all_pages_free(eng)


def test_tensor_parallel_ranks_verify_what_rank_0_drafted(model_dir, plain):
    """TP=2 on CPU (gloo): rank 0 drafts, every rank runs the verify forward it plans."""
    eng = make(model_dir, True, tp_size=2)
    try:
        params = SamplingParams(temperature=1.0, seed=6, max_tokens=16, ignore_eos=True)
        base, got = scripted_run(eng, plain, PROMPTS[:3], params, bad_at=2)
        same(base, got)
    finally:
        eng.close()


def test_warm_up_drafts_every_decode_step_then_starts_clean(model_dir):
    from shared.engine.warmup import warm_up
    eng = make(model_dir, True)
    seen = []
    real = eng.spec.proposer.propose

    def spy(reqs, ks):
        out = real(reqs, ks)
        seen.append((eng.spec.proposer.fill_when_empty, all(len(d.tokens) == k for d, k in zip(out, ks))))
        return out
    eng.spec.proposer.propose = spy
    warm_up(eng, full=True)
    warming = [full for fill, full in seen if fill]
    assert warming and all(warming)  # random tokens match nothing: the decode warm-up filled every draft
    assert eng.spec.stats.verify_steps == 0 and not eng.spec.proposer.fill_when_empty
    assert eng.spec.policy.min_acceptance == 0.0  # this module's engines keep trying
    assert_all_pages_free(eng)


def test_a_speculating_worker_publishes_its_rows_tokens_for_the_routers_simulation(model_dir):
    """Its scheduler leaves K + 1 tokens a decode row in a graph's while it speculates (beside at
    most its speculation's max batch of rows); the router and the planner simulate its budget
    from the registry entry, so the entry says both (shared/perf_model)."""
    from prometheus_client import CollectorRegistry

    from services.worker_runtime.perf_tracker import PerfTracker
    from shared.perf_model.config import PerfModelConfig
    from shared.perf_model.worker_perf import WorkerPerf

    perf = WorkerPerf()
    PerfTracker(make(model_dir, True, speculative_max_batch=3), perf, PerfModelConfig(calibrate=False),
                CollectorRegistry())
    assert (perf.budget_row_tokens, perf.budget_spec_rows) == (5, 3)  # speculative_tokens=4, up to 3 rows
    back = WorkerPerf.from_fields(perf.fields())
    assert (back.budget_row_tokens, back.budget_spec_rows) == (5, 3)
