"""Helpers shared by the gateway and detokenizer tests (no tests in here).

Real tokenizers are built on the spot with the `tokenizers` library and saved as a
model folder that transformers' AutoTokenizer loads, so the tests need no download:
  * byte_level_tokenizer_dir: GPT-2/Qwen style byte-level BPE with a ChatML chat
    template; its merges split CJK characters and emoji across tokens.
  * sentencepiece_tokenizer_dir: Llama-2 style Metaspace BPE with byte fallback,
    whose decoder strips the leading space at the start of a decode.
"""

from __future__ import annotations

import json
from pathlib import Path

CORPUS = [
    "Hello world, the quick brown fox jumps over the lazy dog. Hello there! " * 3,
    "你好世界，今天天气很好。我们一起去公园吧。" * 3,
    "Emoji time 😀🎉👍🏽 café naïve résumé Ελληνικά русский " * 3,
    "The answer is 42. STOP here. The end. " * 3,
]
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_level_tokenizer_dir(folder: Path, max_position_embeddings: int = 256) -> Path:
    """Save a byte-level BPE tokenizer (+ a config.json with the context length) in folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHATML_TEMPLATE
    folder.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(folder))
    config = {"model_type": "qwen2", "max_position_embeddings": max_position_embeddings,
              "eos_token_id": fast.eos_token_id}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def sentencepiece_tokenizer_dir(folder: Path) -> Path:
    """Save a Llama-2 style tokenizer: Metaspace words, <0xNN> byte fallback, space strip."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    base = Tokenizer(models.BPE())
    base.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                  limit_alphabet=60, show_progress=False)
    base.train_from_iterator([CORPUS[0], CORPUS[3]], trainer)
    spec = json.loads(base.to_str())
    vocab = spec["model"]["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    spec["model"]["byte_fallback"] = True
    spec["model"]["unk_token"] = "<unk>"
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.decoder = decoders.Sequence([
        decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0),
    ])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    folder.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(folder))
    return folder


# --- a scripted backend and a real uvicorn server -------------------------------------

import asyncio
import socket
import threading
import time
from dataclasses import dataclass, field


@dataclass
class ScriptedBackend:
    """A GenerationBackend that replays a fixed token script (a stand-in for the engine
    where a test needs exact control: refusals, mid-stream failures, slow tokens).
    It records every request and every early close, which is what the tests check."""

    script: list[int]
    eos_token_id: int
    model_name: str = "tiny"
    max_context_len: int = 256
    delay_s: float = 0.0
    tokens_per_event: int = 1
    refuse: Exception | None = None            # raised before the first token
    fail_after_tokens: int | None = None       # raise `fail_with` after this many tokens
    fail_with: Exception | None = None
    is_ready: bool = True
    requests: list = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    capacity: list = field(default_factory=list)  # WorkerCapacity entries live_capacity() reports
    running: int = 0        # generations in progress now ...
    peak_running: int = 0   # ... and at most so far

    def ready(self) -> bool:
        return self.is_ready

    def live_capacity(self, model: str | None = None) -> list:
        return list(self.capacity)

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def generate(self, request):
        from services.gateway.backends.interface import TokenEvent, TokenLogprob

        self.requests.append(request)
        sampling = request.sampling
        sent = 0
        self.running += 1
        self.peak_running = max(self.peak_running, self.running)
        try:
            if self.refuse is not None:
                raise self.refuse
            script = list(self.script) + [self.eos_token_id]
            if sampling.ignore_eos:  # keep "generating" EOS until max_tokens
                script += [self.eos_token_id] * max(0, sampling.max_tokens - len(script))
            while sent < len(script):
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                batch = script[sent:sent + self.tokens_per_event]
                finish = None
                for i, token in enumerate(batch):
                    n = sent + i + 1
                    if token == self.eos_token_id and not sampling.ignore_eos:
                        finish = "stop"
                    elif n >= sampling.max_tokens:
                        finish = "length"
                    if finish:
                        batch = batch[: i + 1]
                        break
                if self.fail_after_tokens is not None and sent + len(batch) > self.fail_after_tokens:
                    raise self.fail_with
                logprobs = None
                if sampling.logprobs is not None:
                    logprobs = [
                        TokenLogprob(t, -0.25 * (sent + j + 1),
                                     [((t + k) % 300, -0.25 * (sent + j + 1) - k) for k in range(sampling.logprobs)])
                        for j, t in enumerate(batch)
                    ]
                if finish:
                    # Done before the last yield: a consumer may close us right after it.
                    self.finished.append(request.request_id)
                yield TokenEvent(batch, logprobs=logprobs, finish_reason=finish,
                                 cached_tokens=2 if sent == 0 else None)
                sent += len(batch)
                if finish:
                    return
        except (GeneratorExit, asyncio.CancelledError):
            if request.request_id not in self.finished:
                self.cancelled.append(request.request_id)
            raise
        finally:
            self.running -= 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def in_memory_spans():
    """(TracerProvider, InMemorySpanExporter): a tracer provider whose spans a test reads back."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


class LoopThread:
    """An asyncio loop in a thread, for the servers the gateway talks to."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 30):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


class RouterCluster:
    """A real redis-server, the real Router over it and worker registry entries, on a loop
    thread: what a gateway's gRPC backend dials. Subclasses start their (scripted) worker
    servers in `_start_workers` and stop them in `_stop_workers`."""

    def __init__(self, model: str):
        from tests.helpers.redis_server import RedisServer

        self.model = model
        self.redis = RedisServer()
        self.loop = LoopThread()
        self.publishers: dict = {}

    def __enter__(self):
        from services.router.config import RouterConfig
        from services.router.server import RouterServer
        from shared.registry.config import RegistryConfig

        self.redis.start()
        self.registry = RegistryConfig(redis_url=self.redis.url, ttl_s=2.0, heartbeat_interval_s=0.3,
                                       scan_interval_s=0.3, socket_timeout_s=0.5)
        self.router = RouterServer(RouterConfig(host="127.0.0.1", port=0, metrics_port=0, model=self.model,
                                                registry=self.registry))
        self.loop.run(self.router.start())
        self.loop.run(self._start_workers())
        return self

    async def _start_workers(self) -> None:
        pass

    async def _stop_workers(self) -> None:
        pass

    def publish(self, info) -> None:
        """Register a worker entry, as the worker would; returns once the router sees it."""
        from shared.registry.publisher import WorkerPublisher

        async def add():
            publisher = WorkerPublisher(info, self.registry)
            await publisher.start()
            assert await publisher.wait_registered(5)
            self.publishers[info.worker_id] = publisher
            assert await self.router.watcher.wait_for(lambda w: w.is_live(info.worker_id), 5)

        self.loop.run(add())

    def __exit__(self, *exc):
        async def stop():
            for publisher in self.publishers.values():
                await publisher.stop()
            await self.router.stop()
            await self._stop_workers()

        try:
            self.loop.run(stop())
        finally:
            self.loop.close()
            self.redis.stop()


class UvicornThread:
    """A real uvicorn server on 127.0.0.1:<free port>, in a thread of this process."""

    def __init__(self, app, port: int | None = None, **options):
        """options: more uvicorn.Config arguments (e.g. the gateway's uvicorn_limits)."""
        import uvicorn

        self.port = port or free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    lifespan="on", timeout_graceful_shutdown=2, **options))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "UvicornThread":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def wait_until(predicate, timeout: float = 5.0, interval: float = 0.02) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def sse_data(lines) -> list:
    """Parse SSE `data:` payloads (JSON objects, or the string "[DONE]")."""
    import json as _json

    out = []
    for line in lines:
        if line.startswith("data: "):
            payload = line[len("data: "):]
            out.append(payload if payload == "[DONE]" else _json.loads(payload))
    return out
