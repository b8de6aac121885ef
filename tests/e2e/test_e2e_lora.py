"""LoRA adapters end to end: `duet up` split (a prefill and a decode worker, the KV over NIXL) and
colocated (one `both` worker), with an API key, real processes on the CPU, the official openai
client; random-weight adapters saved by PEFT, references from transformers + PEFT merged.

- `alpha`, given at start (`-- --lora alpha=PATH`), is listed by /v1/models with the base model as
  its parent; `model=alpha` gives exactly the merged model's greedy text, the base model its own.
- `beta`, loaded at run time with vLLM's POST /v1/load_lora_adapter (API key required), is listed,
  served and recorded in the registry for workers that start later; a mixed burst of base, alpha and beta requests gives each its own text; after
  /v1/unload_lora_adapter it is gone: a 404 model_not_found in OpenAI's format, as for a name
  nobody ever had.
- The same prompt under the base model and then an adapter finds nothing cached (pages are never
  shared across adapters), while the adapter's own second request does.
- The registry lists each worker's adapters, and the ones in its device slots.
"""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from tests.helpers.engine_models import hf_greedy, load_hf
from tests.helpers.lora_adapters import merged_model, save_random_adapter
from tests.helpers.stack import PREFIX, DuetUp, managed, model_dir, new_log_dir

pytestmark = pytest.mark.slow

KEY = "sk-lora-e2e-7f3a9c21"
MODEL = "SmolLM2-135M-Instruct"
PROMPTS = ["The capital of France is", "def fibonacci(n):"]
MAX_NEW = 10
MODES = {"split": ("--prefill", "1", "--decode", "1"),
         "colocated": ("--both", "1", "--prefill", "0", "--decode", "0")}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """({name: folder}, {name or "": [greedy text per prompt]}) from transformers + PEFT."""
    from transformers import AutoTokenizer
    root = tmp_path_factory.mktemp("lora-e2e")
    base = model_dir()
    folders = {"alpha": save_random_adapter(base, root / "alpha", rank=8, seed=11),
               "beta": save_random_adapter(base, root / "beta", rank=4, seed=12, targets=("q_proj", "o_proj",
                                                                                          "up_proj"))}
    tok = AutoTokenizer.from_pretrained(base)
    ids = [tok(p).input_ids for p in PROMPTS]
    torch.set_num_threads(1)
    texts = {"": [tok.decode(hf_greedy(load_hf(base, torch.float32), i, MAX_NEW), skip_special_tokens=True)
                  for i in ids]}
    for name, folder in folders.items():
        model = merged_model(base, folder)
        texts[name] = [tok.decode(hf_greedy(model, i, MAX_NEW), skip_special_tokens=True) for i in ids]
    assert texts["alpha"] != texts[""] and texts["beta"] != texts[""]
    return folders, texts


@pytest.fixture(scope="module", params=list(MODES))
def stack(request, adapters):
    folders, _ = adapters
    up = DuetUp(new_log_dir(f"lora-{request.param}"), "--api-key", KEY, "--enable-lora-loading",
                *MODES[request.param], kv_cache_memory="96M", worker_args=["--lora", f"alpha={folders['alpha']}"])
    with managed(request, up.start()) as s:
        s.wait_ready()
        yield s


def _client(stack):
    import openai
    return openai.OpenAI(base_url=stack.base_url, api_key=KEY, max_retries=0, timeout=120)


def _complete(client, model: str, prompt: str):
    r = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_NEW, temperature=0)
    return r.choices[0].text, r.usage.prompt_tokens_details.cached_tokens if r.usage.prompt_tokens_details else 0


def _admin(stack, path: str, body: dict, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(stack.base_url + path, json=body, headers=headers, timeout=60)


def test_an_adapter_given_at_start_is_listed_and_gives_the_merged_models_text(stack, adapters):
    _, texts = adapters
    client = _client(stack)
    cards = {m.id: m for m in client.models.list()}
    assert set(cards) == {MODEL, "alpha"}
    assert cards["alpha"].model_extra["parent"] == MODEL and cards[MODEL].model_extra["parent"] is None
    for i, prompt in enumerate(PROMPTS):
        text, _ = _complete(client, "alpha", prompt)
        assert text == texts["alpha"][i], prompt
        assert _complete(client, MODEL, prompt)[0] == texts[""][i], prompt
    chat = client.chat.completions.create(model="alpha", messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=4, temperature=0)
    assert chat.model == "alpha"
    entries = stack.workers().values()
    assert entries and all(json.loads(e["lora_adapters"]) == ["alpha"] for e in entries)
    assert all(json.loads(e["lora_resident"]) == ["alpha"] for e in entries)  # it ran everywhere


def test_an_adapter_loaded_at_run_time_serves_beside_the_others_until_unloaded(stack, adapters):
    import openai
    folders, texts = adapters
    client = _client(stack)
    body = {"lora_name": "beta", "lora_path": str(folders["beta"])}
    assert _admin(stack, "/load_lora_adapter", body, key=None).status_code == 401
    bad = _admin(stack, "/load_lora_adapter", {"lora_name": "gamma", "lora_path": "/no/such/folder"})
    assert bad.status_code == 400 and "adapter_config.json" in bad.json()["error"]["message"]
    loaded = _admin(stack, "/load_lora_adapter", body)
    assert loaded.status_code == 200, loaded.text
    assert _admin(stack, "/load_lora_adapter", body).status_code == 400  # loaded already
    assert {m.id for m in client.models.list()} == {MODEL, "alpha", "beta"}
    record = f"{PREFIX}:model:{MODEL}:lora"  # a worker that starts later loads it too
    assert stack.redis().hgetall(record) == {"beta": str(folders["beta"])}
    jobs = [(name, i) for name in ("beta", "", "alpha") for i in range(len(PROMPTS))]
    with ThreadPoolExecutor(len(jobs)) as pool:  # one burst: the steps mix base and both adapters
        got = list(pool.map(lambda job: _complete(client, job[0] or MODEL, PROMPTS[job[1]])[0], jobs))
    assert got == [texts[name][i] for name, i in jobs]
    assert _admin(stack, "/unload_lora_adapter", {"lora_name": "beta"}).status_code == 200
    assert {m.id for m in client.models.list()} == {MODEL, "alpha"}
    assert stack.redis().hgetall(record) == {}
    for name in ("beta", "never-loaded"):
        with pytest.raises(openai.NotFoundError) as err:
            _complete(client, name, PROMPTS[0])
        assert err.value.body["code"] == "model_not_found" and err.value.body["param"] == "model"
    gone = _admin(stack, "/unload_lora_adapter", {"lora_name": "beta"})
    assert gone.status_code == 404 and gone.json()["error"]["message"] == "The lora adapter 'beta' cannot be found."


def test_the_base_model_and_an_adapter_never_share_cached_pages(stack):
    client = _client(stack)
    prompt = " ".join(["Tea ships from Rotterdam on weekdays and arrives within five days."] * 6)
    _complete(client, MODEL, prompt)
    assert _complete(client, MODEL, prompt)[1] > 0  # the base model's own pages are reused
    assert _complete(client, "alpha", prompt)[1] == 0  # but never the adapter's
    assert _complete(client, "alpha", prompt)[1] > 0
