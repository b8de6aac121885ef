"""The `duet` command: dispatch, `duet generate` and `duet chat` against the offline LLM API."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

from services import cli
from shared.model_files.default_model import ensure_default_model

REPO_ROOT = Path(__file__).resolve().parents[2]


def run_duet(args: list[str], stdin: str | None = None, timeout: float = 300, env: dict | None = None):
    full_env = dict(os.environ, **(env or {}))
    full_env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + full_env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-m", "services.cli", *args], input=stdin, capture_output=True,
                          text=True, timeout=timeout, cwd=REPO_ROOT, env=full_env)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return ensure_default_model(cache_dir=tmp_path_factory.mktemp("duet-cache"), progress=False)


@pytest.fixture(scope="module")
def llm(model_dir):
    from shared.engine import LLM

    return LLM(str(model_dir), dtype="float32", device="cpu")


# -- dispatch -------------------------------------------------------------------------------

def test_help_lists_every_command_with_a_description():
    proc = run_duet(["--help"], timeout=60)
    assert proc.returncode == 0
    for command in cli.COMMANDS:
        line = next((ln for ln in proc.stdout.splitlines() if ln.split()[:1] == [command.name]), None)
        assert line is not None, command.name
        assert command.help in line


def test_unknown_command_is_a_usage_error():
    proc = run_duet(["generat"], timeout=60)
    assert proc.returncode == 2
    assert "unknown command 'generat'" in proc.stderr
    assert "did you mean 'generate'" in proc.stderr
    assert proc.stdout == ""


def test_no_command_prints_help_and_fails():
    proc = run_duet([], timeout=60)
    assert proc.returncode == 2
    assert "convert-default-model" in proc.stderr


def test_missing_module_or_dependency_is_reported(tmp_path, monkeypatch, capsys):
    (tmp_path / "duet_needs_missing_dep.py").write_text("import duet_no_such_dependency\ndef main(argv):\n    return 0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(cli.COMMANDS_BY_NAME, "router",
                        cli.Command("router", "services.router.no_such_module:main", "x"))
    assert cli.main(["router"]) == 2
    assert "module services.router.no_such_module is missing" in capsys.readouterr().err
    monkeypatch.setitem(cli.COMMANDS_BY_NAME, "router", cli.Command("router", "duet_needs_missing_dep:main", "x"))
    assert cli.main(["router"]) == 2
    assert "needs the Python package 'duet_no_such_dependency'" in capsys.readouterr().err


def test_role_commands_inject_the_role(tmp_path, monkeypatch):
    """`duet prefill ARGS` runs the worker's main with `--role prefill ARGS`, and its status is returned."""
    (tmp_path / "duet_echo_worker.py").write_text(
        "import json\nSEEN = []\ndef main(argv):\n    SEEN.append(list(argv))\n    return 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for role in ("prefill", "decode"):
        real = cli.COMMANDS_BY_NAME[role]
        assert real.target == "services.worker.main:main"
        monkeypatch.setitem(cli.COMMANDS_BY_NAME, role, dataclasses.replace(real, target="duet_echo_worker:main"))
        assert cli.main([role, "--port", "5", "--model", "m"]) == 3
    import duet_echo_worker

    assert duet_echo_worker.SEEN == [["--role", "prefill", "--port", "5", "--model", "m"],
                                     ["--role", "decode", "--port", "5", "--model", "m"]]


# -- generate -------------------------------------------------------------------------------

def test_generate_with_bad_model_path_is_a_clear_error(tmp_path):
    missing = tmp_path / "missing-model"
    proc = run_duet(["generate", "--model", str(missing), "--prompt", "hi"], timeout=60)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert f"--model {missing}: no such directory" in proc.stderr


def test_generate_rejects_bad_sampling_values(model_dir):
    proc = run_duet(["generate", "--model", str(model_dir), "--prompt", "hi", "--temperature", "-1"], timeout=60)
    assert proc.returncode == 2
    assert "temperature must be >= 0" in proc.stderr
    assert proc.stdout == ""


def test_generate_prints_exactly_the_greedy_completion(model_dir, llm):
    from shared.engine import SamplingParams

    prompt = "The capital of France is"
    proc = run_duet(["generate", "--model", str(model_dir), "--prompt", prompt, "--max-tokens", "10",
                     "--temperature", "0", "--dtype", "float32", "--device", "cpu"])
    assert proc.returncode == 0, proc.stderr
    expected = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=10))[0]
    assert len(expected.token_ids) == 10
    assert proc.stdout == expected.text + "\n"
    assert "Paris" in proc.stdout


# -- chat -----------------------------------------------------------------------------------

def test_chat_two_turns_through_stdin(model_dir, llm):
    from shared.engine import SamplingParams
    from services.offline.chat import encode_chat, stream_answer

    questions = ["What is the capital of France?", "And of Germany?"]
    proc = run_duet(["chat", "--model", str(model_dir), "--max-tokens", "24", "--temperature", "0",
                     "--dtype", "float32"], stdin="\n".join(questions) + "\n/exit\nnot read\n")
    assert proc.returncode == 0, proc.stderr
    answers = proc.stdout.split("\n")
    assert answers[-1] == "" and len(answers) == 3, proc.stdout

    # The same conversation through the offline API, turn by turn, gives the same answers.
    params = SamplingParams(temperature=0.0, max_tokens=24)
    messages = []
    for question, answer in zip(questions, answers):
        messages.append({"role": "user", "content": question})
        expected = llm.generate([encode_chat(llm.tokenizer, messages)], params)[0].text
        assert answer == expected
        if len(messages) == 1:  # the answer arrives in pieces as tokens are made, not at the end
            pieces = list(stream_answer(llm, encode_chat(llm.tokenizer, messages), params))
            assert len(pieces) > 3 and "".join(pieces) == expected
        messages.append({"role": "assistant", "content": expected})
    assert "Paris" in answers[0]
    assert "Berlin" in answers[1]  # only answerable with the first turn in the history
