"""Settings declared once (shared/settings): flags, DUET_* variables and defaults from one field
declaration; the engine's settings reaching `duet worker`, parsed once (values given in code
too); the table of every variable (`duet env`) agreeing with what each command's --help shows,
but for the internal settings, whose flags are accepted and hidden."""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from services.env_vars import table
from services.gateway.config import GatewayConfig
from services.worker.config import WorkerConfig
from shared.engine.config import EngineConfig
from shared.settings import parsers
from shared.settings.flags import add_flags, format_value, from_args, parse_argv
from shared.settings.spec import check_values, nested, setting, walk

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Inner:
    path: str | None = setting(flag="--inner-path", env="T_INNER_PATH", help="a path")
    secret: str | None = setting(env="T_SECRET", secret=True, help="environment only")


@dataclass
class Toy:
    count: int = setting(3, flag="--count", env="T_COUNT", help="an int")
    ratio: float = setting(0.5, flag="--ratio", env="T_RATIO", help="a float")
    on: bool = setting(True, flag="--on", env="T_ON", off_flags=("--disable-on",), help="a bool")
    maybe: bool | None = setting(None, flag="--maybe", env="T_MAYBE", parse=parsers.boolean, help="optional")
    budget: int | None = setting(None, flag="--budget", env="T_BUDGET", parse=parsers.optional_size, help="size")
    mode: str = setting("a", flag="--mode", env="T_MODE", choices=("a", "b"), help="a choice")
    depths: dict[str, int] = setting({}, flag="--depths", env="T_DEPTHS", parse=parsers.name_counts,
                                     internal=True, help="an experiment's knob")
    keys: list[str] = setting(flag="--key", env="T_KEYS", repeat=True, help="repeatable")
    plain: int = 7  # not a setting: keeps its default
    inner: Inner = nested(Inner, "inner")


def test_flag_then_variable_then_default_through_nested_dataclasses():
    assert parse_argv(Toy, [], {}) == Toy()
    env = {"T_COUNT": "5", "T_ON": "off", "T_MAYBE": "yes", "T_BUDGET": "2M", "T_MODE": "b", "T_KEYS": "k1, k2",
           "T_INNER_PATH": "/p", "T_SECRET": "s", "T_RATIO": ""}  # empty: unset
    got = parse_argv(Toy, [], env)
    assert (got.count, got.ratio, got.on, got.maybe, got.budget, got.mode, got.keys) == \
        (5, 0.5, False, True, 2 << 20, "b", ["k1", "k2"])
    assert (got.inner.path, got.inner.secret, got.plain) == ("/p", "s", 7)
    got = parse_argv(Toy, ["--count", "9", "--on", "--no-maybe", "--budget", "0", "--key", "k3",
                           "--inner-path", "/q"], env)
    assert (got.count, got.on, got.maybe, got.budget, got.keys, got.inner.path) == \
        (9, True, False, None, ["k1", "k2", "k3"], "/q")  # a repeated flag adds to the variable's items
    assert parse_argv(Toy, ["--disable-on"], {}).on is False


def test_bad_values_name_their_source(capsys):
    with pytest.raises(SystemExit):
        parse_argv(Toy, [], {"T_COUNT": "many"})
    assert "T_COUNT='many'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_argv(Toy, [], {"T_MODE": "c"})
    assert "T_MODE='c': choose one of a, b" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_argv(Toy, ["--mode", "c"], {})
    assert "invalid choice: 'c'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_argv(Toy, [], {"T_ON": "maybe"})
    assert "T_ON='maybe'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_argv(Toy, [], {"T_BUDGET": "lots"})
    assert "T_BUDGET='lots'" in capsys.readouterr().err


def test_an_internal_flag_is_accepted_but_hidden_from_help():
    p = argparse.ArgumentParser()
    add_flags(p, Toy, {})
    assert "--depths" not in p.format_help() and "T_DEPTHS" not in p.format_help()
    assert parse_argv(Toy, ["--depths", "o_proj=8, qkv_proj=0"], {}).depths == {"o_proj": 8, "qkv_proj": 0}
    assert parse_argv(Toy, [], {"T_DEPTHS": "a=1"}).depths == {"a": 1}
    assert Toy().depths == {} and Toy().depths is not Toy().depths  # a fresh dict each
    worker = WorkerConfig.parser({}).format_help()
    assert "--pdl " in worker.replace("\n", " ")  # a public kernel-path flag is shown
    for flag in ("--pdl-prefetch", "--custom-all-reduce-mode", "DUET_PDL_PREFETCH", "DUET_CUSTOM_ALLREDUCE"):
        assert flag not in worker, flag
    c = WorkerConfig.from_argv(["--pdl-prefetch-at", "o_proj=8", "--custom-all-reduce-mode", "barrier"], {})
    assert (c.engine.pdl_prefetch_at, c.engine.custom_all_reduce_mode) == ({"o_proj": 8}, "barrier")


def test_name_counts_parser():
    assert parsers.name_counts("") == {} and parsers.name_counts(" o_proj=8, qkv_proj=0") == {"o_proj": 8, "qkv_proj": 0}
    for bad in ("o_proj", "o_proj=-1", "=3", "o_proj=two"):
        with pytest.raises(ValueError, match="name=count pairs"):
            parsers.name_counts(bad)


@pytest.mark.parametrize("argv,env,message", [
    (["--small-batch-linear", "1"], {}, "argument --small-batch-linear: invalid choice: '1'"),  # an old alias
    (["--pdl", "yes"], {}, "argument --pdl: invalid choice: 'yes'"),
    (["--fp8-decode-gemm", "maybe"], {}, "argument --fp8-decode-gemm: invalid choice: 'maybe'"),
    (["--attention-backend", "fast"], {}, "argument --attention-backend: invalid choice: 'fast'"),
    (["--pdl-prefetch-at", "o_proj"], {}, "argument --pdl-prefetch-at: invalid name=int,... value: 'o_proj'"),
    ([], {"DUET_SMALL_BATCH_LINEAR": "on"}, "DUET_SMALL_BATCH_LINEAR='on': choose one of auto, lm_head, all, off"),
    ([], {"DUET_KV_CACHE_DTYPE": "fp8"}, "DUET_KV_CACHE_DTYPE='fp8': choose one of auto, fp8_e4m3"),
])
def test_a_bad_kernel_path_value_is_refused_at_parse_time(argv, env, message, capsys):
    with pytest.raises(SystemExit):
        WorkerConfig.from_argv(argv, env)
    assert message in capsys.readouterr().err


def test_values_given_in_code_are_parsed_by_the_same_declarations():
    """The offline API and the benchmarks build EngineConfig in code: text goes through each
    setting's parser and choices, so the engine gets typed values whoever built the config."""
    c = EngineConfig(pdl_prefetch_at="o_proj=8", overlap_schedule="off", page_size="32", max_model_len="0")
    assert (c.pdl_prefetch_at, c.overlap_schedule, c.page_size, c.max_model_len) == ({"o_proj": 8}, False, 32, None)
    assert EngineConfig().with_options(tp=2, pdl="off").tp_size == 2
    with pytest.raises(ValueError, match=r"small_batch_linear='on' \(--small-batch-linear\): choose one of auto, "):
        EngineConfig(small_batch_linear="on")  # an alias the flag never took
    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp8' \(--kv-cache-dtype\): choose one of auto, fp8_e4m3"):
        EngineConfig().with_options(kv_cache_dtype="fp8")
    c.grammar.max_bytes = "1K"  # nested settings too
    check_values(c)
    assert c.grammar.max_bytes == 1024
    with pytest.raises(TypeError, match="unknown engine option 'pdl_prefech'"):
        EngineConfig().with_options(pdl_prefech=1)


def test_help_names_the_variable_and_default_but_never_a_secret():
    p = argparse.ArgumentParser()
    add_flags(p, Toy, {"T_COUNT": "5"})
    text = " ".join(p.format_help().split())
    assert "an int [env T_COUNT=5; default: 3]" in text and "a bool [env T_ON; default: on]" in text
    assert "--on, --no-on" in text and "same as --no-on" in text and "T_SECRET" not in text
    gateway = " ".join(GatewayConfig.parser({"DUET_API_KEYS": "sk-hidden"}).format_help().split())
    assert "sk-hidden" not in gateway and "env DUET_API_KEYS=***" in gateway


def test_every_engine_setting_reaches_the_worker_by_flag_and_variable():
    """Adding an engine setting is one field in EngineConfig: `duet worker` takes it by flag and
    by DUET_* variable, and WorkerConfig.engine carries it to the engine."""
    specs = list(walk(EngineConfig))
    assert len(specs) > 20
    flags = WorkerConfig.parser({}).format_help()
    for path, spec in specs:  # a path: a field of EngineConfig or of a dataclass it nests
        name = ".".join(path)
        assert (spec.flag in flags) != spec.internal and spec.env, name  # internal: accepted, not shown
        value = _non_default(spec)
        text = format_value(value)
        assert _field(WorkerConfig.from_argv([], {spec.env: text}).engine, path) == value, name
        argv = [spec.flag if value else f"--no-{spec.flag[2:]}"] if spec.is_bool else [spec.flag, text]
        assert _field(WorkerConfig.from_argv(argv, {}).engine, path) == value, name


def _field(obj, path):
    for name in path:
        obj = getattr(obj, name)
    return obj


def _non_default(spec):
    if spec.is_bool:
        return not spec.default if spec.default is not None else False
    if spec.choices:
        return next(c for c in spec.choices if c != spec.default)
    if spec.parse in (parsers.optional_size, parsers.size):
        return 3 << 30
    sample = {int: 3, float: 0.25, str: "x", parsers.optional_int: 3, parsers.name_counts: {"o_proj": 3},
              parsers.words: ["x=/y"]}
    return sample[spec.parse] if spec.default != sample[spec.parse] else sample[spec.parse] * 2


@pytest.mark.parametrize("argv,env,check", [
    (["--disable-prefix-cache", "--disable-cuda-graph", "--no-recompute"], {},
     lambda c: (c.engine.enable_prefix_cache, c.engine.cuda_graph, c.recompute_on_missing_kv) == (False, False, False)),
    (["--nixl-progress-thread", "--no-warmup", "--no-overlap-schedule"], {},
     lambda c: (c.nixl_progress_thread, c.warmup, c.engine.overlap_schedule) == (True, False, False)),
    ([], {"DUET_MAX_RUNNING": "8", "DUET_MAX_BATCHED_TOKENS": "512", "DUET_KV_CACHE_MEMORY": "512M",
          "DUET_THREADS": "2", "DUET_TP": "2", "DUET_EP": "2", "DUET_OVERLAP_SCHEDULE": "0",
          "DUET_NIXL_PROGRESS_THREAD": "1", "DUET_WARMUP": "0", "DUET_MODEL": "/m", "DUET_PDL": "off"},
     lambda c: (c.engine.max_running_requests, c.engine.max_num_batched_tokens, c.engine.kv_cache_memory,
                c.engine.num_threads, c.engine.tp_size, c.engine.ep_size, c.engine.overlap_schedule,
                c.nixl_progress_thread, c.warmup, c.engine.model_dir, c.engine.pdl)
     == (8, 512, 512 << 20, 2, 2, 2, False, True, False, "/m", "off")),
    ([], {"DUET_KV_CACHE_MEMORY": "0", "DUET_MAX_MODEL_LEN": "0"},
     lambda c: (c.engine.kv_cache_memory, c.engine.max_model_len) == (None, None)),
])
def test_worker_keeps_its_flag_and_variable_names(argv, env, check):
    assert check(WorkerConfig.from_argv(argv, env))


def test_engine_gpu_knobs_still_read_the_environment_when_built_in_code(monkeypatch):
    """The benchmarks build EngineConfig in code and are tuned by these variables
    (e.g. `DUET_PDL=off duet bench --sections decode`)."""
    monkeypatch.setenv("DUET_PDL", "off")
    monkeypatch.setenv("DUET_SMALL_BATCH_LINEAR", "all")
    monkeypatch.setenv("DUET_CUSTOM_ALLREDUCE", "barrier")
    monkeypatch.setenv("DUET_PDL_PREFETCH", "3")
    monkeypatch.setenv("DUET_PDL_PREFETCH_AT", "o_proj=2")
    monkeypatch.setenv("DUET_PAGE_SIZE", "64")  # a plain setting: flags and variables only
    c = EngineConfig()
    assert (c.pdl, c.small_batch_linear, c.custom_all_reduce_mode, c.pdl_prefetch_k_blocks, c.pdl_prefetch_at,
            c.page_size) == ("off", "all", "barrier", 3, {"o_proj": 2}, 16)


def test_drain_grace_is_one_setting_with_one_default():
    entry = table()["DUET_DRAIN_GRACE"]
    assert {r.command for r in entry.readers} == {"worker", "gateway", "up"} and len(entry.defaults) == 1
    assert WorkerConfig.from_argv([], {}).drain_grace_s == GatewayConfig.from_argv([], {}).drain_grace_s == 10.0
    assert GatewayConfig.from_argv([], {"DUET_DRAIN_GRACE": "60"}).drain_grace_s == 60.0


def test_shared_variables_are_one_entry_naming_every_reader():
    t = table()
    assert {r.command for r in t["DUET_HOST"].readers} == {"worker", "gateway", "up"}
    assert t["DUET_HOST"].default_for("gateway") == "0.0.0.0" and t["DUET_HOST"].default_for("worker") == "127.0.0.1"
    assert {r.command for r in t["DUET_SERVED_MODEL_NAME"].readers} == {"worker", "gateway", "router", "planner"}
    assert {r.command for r in t["DUET_SLO_ITL_MS"].readers} == {"worker", "router", "planner", "up"}
    assert {"worker", "gateway", "router", "duet"} <= {r.command for r in t["DUET_LOG_LEVEL"].readers}
    assert t["DUET_TP_KEY"].internal and t["DUET_TP_ADDR"].internal
    assert "up" in {r.command for r in t["DUET_TP"].readers}


# --- --help and the table agree ---------------------------------------------------------------

def _help_settings(command: str) -> dict[str, str]:
    """Variable -> the default `duet COMMAND --help` shows for it ("" when none shown)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DUET_")}
    env.update(COLUMNS="10000", PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-m", "services.cli", command, "--help"], capture_output=True, text=True,
                         env=env, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    found = {}
    for m in re.finditer(r"\[env (DUET_\w+)(?:; default: ([^\]]*))?\]", out.stdout):
        found[m.group(1)] = m.group(2) or ""
    options: list[str] = []  # one entry an option: its line and the help lines under it
    for ln in out.stdout.splitlines():
        if ln.startswith("  -"):
            options.append(ln)
        elif ln.startswith("   ") and options:
            options[-1] += ln
    bare = [o.split()[0] for o in options
            if "[env " not in o and "same as --no-" not in o and not o.strip().startswith("-h")]
    assert not bare, f"{command}: flags without a DUET_* variable: {bare}"
    return found


@pytest.mark.parametrize("command", ["worker", "gateway", "router", "planner"])
def test_help_flags_and_the_variable_table_agree(command):
    shown = _help_settings(command)
    listed = {v.name: v for v in table().values()
              if any(r.command == command and r.flag for r in v.readers) and not v.internal}
    assert set(shown) == set(listed), (set(shown) ^ set(listed))
    for name, var in listed.items():
        if not var.secret:
            assert shown[name] == format_value(var.default_for(command)), name


def test_duet_env_prints_the_table():
    env = dict(os.environ, PYTHONPATH=str(REPO), DUET_PORT="9000", DUET_REDIS_PASSWORD="hunter2")
    out = subprocess.run([sys.executable, "-m", "services.cli", "env"], capture_output=True, text=True, env=env,
                         cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "DUET_DRAIN_GRACE  (float; read by worker, gateway, up)" in out.stdout
    assert "set now: 9000" in out.stdout and "hunter2" not in out.stdout and "set now: ***" in out.stdout
    rows = json.loads(subprocess.run([sys.executable, "-m", "services.cli", "env", "--json", "--no-internal"],
                                     capture_output=True, text=True, env=env, cwd=REPO, timeout=120).stdout)
    names = {r["name"] for r in rows}
    assert "DUET_PAGE_SIZE" in names and "DUET_TP_KEY" not in names and "DUET_PDL_PREFETCH_AT" not in names
    public, internal = out.stdout.split("Internal: ")
    assert "DUET_PDL  (" in public and "DUET_PDL_PREFETCH_AT" not in public
    assert "DUET_PDL_PREFETCH_AT  (name=int,...; read by worker; flag --pdl-prefetch-at;" in internal
    assert "DUET_TP_KEY" in internal
    page = next(r for r in rows if r["name"] == "DUET_PAGE_SIZE")
    assert page["readers"] == [{"command": "worker", "flag": "--page-size", "default": "16",
                                "help": "tokens per KV page"}]


def test_worker_flags_parse_without_torch():
    """`duet worker --help` and `duet env` answer at once: nothing they import loads torch."""
    code = ("import sys; import services.env_vars, services.worker.main, services.launcher.gpus; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120,
                         env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert out.returncode == 0, out.stderr
