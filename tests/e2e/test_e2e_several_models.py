"""Two base models behind one gateway and router: `duet up --model A --model B`.

A is the embedded default (SmolLM2-135M), B a tiny random-weight Llama with the same tokenizer
files but a chat template of its own (another system prompt), so a request tokenized with the
wrong model's template would show in its prompt token count. Each model answers as itself
through the official openai client (greedy, against that model's offline engine), /v1/models
lists both, an unknown model is OpenAI's 404 `model_not_found`, and requests for B never reach
A's workers (their request counters stay still). A LoRA adapter of B's shapes loaded at run time
with `base_model` B goes to B's workers only, is listed with B as its parent, answers as
transformers + PEFT merged into B, and is recorded in B's registry record alone."""
from __future__ import annotations

import json
import shutil

import openai
import pytest

from tests.helpers.engine_models import hf_greedy
from tests.helpers.lora_adapters import merged_model, save_random_adapter
from tests.helpers.stack import PREFIX, DuetUp, managed, model_dir, new_log_dir, offline_llm, offline_outputs
from tests.helpers.tiny_models import make_tiny_model

pytestmark = pytest.mark.slow

MAX_TOKENS = 8
MESSAGES = [{"role": "user", "content": "Name a color."}]
B_SYSTEM = "You are model B, a tiny random network."
A_WORKERS = ("prefill-0", "decode-0")
B_WORKERS = ("m1-prefill-0", "m1-decode-0")
WORKER_RPCS = ("Reserve", "Prefill", "Generate")


def make_model_b(folder):
    """A tiny Llama (random weights) that tokenizes as SmolLM2 but with its own chat template."""
    default = model_dir()
    config = json.loads((default / "config.json").read_text())
    make_tiny_model(folder, "llama", vocab=config["vocab_size"], seed=7)
    for name in ("tokenizer.json", "generation_config.json"):
        shutil.copy(default / name, folder / name)
    tok_config = json.loads((default / "tokenizer_config.json").read_text())
    tok_config["chat_template"] = (
        "{{ '<|im_start|>system\\n" + B_SYSTEM + "<|im_end|>\\n' }}"
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
        "+ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config))
    return folder


@pytest.fixture(scope="module")
def model_b(tmp_path_factory):
    return make_model_b(tmp_path_factory.mktemp("models") / "tiny-llama-b")


@pytest.fixture(scope="module")
def stack(request, model_b):
    with managed(request, DuetUp(new_log_dir("up-models"), "--model", str(model_dir()), "--model", str(model_b),
                                 "--insecure", "--enable-lora-loading",
                                 worker_args=["--max-loras", "2"]).start()) as stack:
        yield stack


def chat_prompt(folder) -> list[int]:
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(folder))
    text = tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def references(stack, model_b):
    """Each model's offline answer to the chat, computed while the stack boots."""
    out = {}
    for name, folder in (("SmolLM2-135M-Instruct", model_dir()), ("tiny-llama-b", model_b)):
        ids = chat_prompt(folder)
        out[name] = (ids, offline_outputs(offline_llm(folder), [ids], MAX_TOKENS)[0])
    stack.wait_ready()
    return out


def worker_rpcs(stack, worker_id: str) -> float:
    metrics = stack.metrics(worker_id)
    return sum(metrics.value("duet_requests_total", endpoint=rpc) for rpc in WORKER_RPCS)


def test_two_models_each_answer_as_itself_on_their_own_workers(stack, references):
    client = stack.client()
    assert sorted(m.id for m in client.models.list().data) == ["SmolLM2-135M-Instruct", "tiny-llama-b"]
    entries = stack.workers()
    assert {w: entries[w]["model"] for w in A_WORKERS + B_WORKERS} == {
        **dict.fromkeys(A_WORKERS, "SmolLM2-135M-Instruct"), **dict.fromkeys(B_WORKERS, "tiny-llama-b")}
    assert references["SmolLM2-135M-Instruct"][0] != references["tiny-llama-b"][0]  # their own templates

    before = {w: worker_rpcs(stack, w) for w in A_WORKERS}
    ids, want = references["tiny-llama-b"]
    got = client.chat.completions.create(model="tiny-llama-b", messages=MESSAGES, max_tokens=MAX_TOKENS,
                                         temperature=0)
    assert got.model == "tiny-llama-b"
    assert got.usage.prompt_tokens == len(ids)  # tokenized with B's chat template
    assert (got.choices[0].message.content, got.choices[0].finish_reason) == (want.text, want.finish_reason)
    assert got.usage.completion_tokens == len(want.token_ids)
    assert {w: worker_rpcs(stack, w) for w in A_WORKERS} == before  # B never reached A's workers
    assert all(worker_rpcs(stack, w) > 0 for w in B_WORKERS)

    ids, want = references["SmolLM2-135M-Instruct"]
    got = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=MESSAGES,
                                         max_tokens=MAX_TOKENS, temperature=0)
    assert got.model == "SmolLM2-135M-Instruct" and got.usage.prompt_tokens == len(ids)
    assert (got.choices[0].message.content, got.choices[0].finish_reason) == (want.text, want.finish_reason)
    assert all(worker_rpcs(stack, w) > before[w] for w in A_WORKERS)

    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="no-such-model", messages=MESSAGES, max_tokens=2)
    assert err.value.status_code == 404
    assert err.value.body["code"] == "model_not_found" and err.value.body["type"] == "invalid_request_error"


def test_an_adapter_loaded_at_run_time_for_model_b_runs_on_bs_workers_alone(stack, references, model_b, tmp_path):
    import httpx
    import torch
    from transformers import AutoTokenizer

    folder = save_random_adapter(model_b, tmp_path / "b-lora", rank=4, seed=5)
    ids, base = references["tiny-llama-b"]
    torch.set_num_threads(1)
    want = AutoTokenizer.from_pretrained(str(model_b)).decode(
        hf_greedy(merged_model(model_b, folder), ids, MAX_TOKENS), skip_special_tokens=True)
    assert want != base.text  # the adapter changes B's answer

    def admin(path: str, body: dict) -> httpx.Response:
        return httpx.post(stack.base_url + path, json=body, timeout=60)

    body = {"lora_name": "b-lora", "lora_path": str(folder), "base_model": "tiny-llama-b"}
    for served in ("SmolLM2-135M-Instruct", "tiny-llama-b"):  # requests naming it would reach the model
        clash = admin("/load_lora_adapter", {**body, "lora_name": served})
        assert clash.status_code == 400 and "name of a served model" in clash.json()["error"]["message"], clash.text
    unknown = admin("/load_lora_adapter", {**body, "base_model": "no-such-model"})
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found", unknown.text
    loaded = admin("/load_lora_adapter", body)
    assert loaded.status_code == 200, loaded.text
    cards = {m["id"]: m for m in httpx.get(stack.base_url + "/models", timeout=10).json()["data"]}
    assert cards["b-lora"]["parent"] == "tiny-llama-b"
    entries = stack.workers()
    assert all("b-lora" in json.loads(entries[w]["lora_adapters"]) for w in B_WORKERS)
    assert not any("b-lora" in json.loads(entries[w]["lora_adapters"]) for w in A_WORKERS)
    r = stack.redis()
    assert r.hgetall(f"{PREFIX}:model:tiny-llama-b:lora") == {"b-lora": str(folder)}
    assert r.hgetall(f"{PREFIX}:model:SmolLM2-135M-Instruct:lora") == {}

    before = {w: worker_rpcs(stack, w) for w in A_WORKERS}
    got = stack.client().chat.completions.create(model="b-lora", messages=MESSAGES, max_tokens=MAX_TOKENS,
                                                 temperature=0)
    assert got.model == "b-lora" and got.usage.prompt_tokens == len(ids)  # B's chat template
    assert got.choices[0].message.content == want
    assert {w: worker_rpcs(stack, w) for w in A_WORKERS} == before  # never on A's workers

    assert admin("/unload_lora_adapter", {"lora_name": "b-lora"}).status_code == 200
    assert "b-lora" not in {m.id for m in stack.client().models.list().data}
    assert r.hgetall(f"{PREFIX}:model:tiny-llama-b:lora") == {}
