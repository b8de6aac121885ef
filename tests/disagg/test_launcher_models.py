"""`duet up --model A --model B` (services/launcher/main.py, Stack.plan): a pool of workers per
model (the counts apply per model, the second model's workers named m1-...), each started on its
own folder; one router; one gateway given the first as --model and the others as --extra-model;
with the planner on, a planner per model given that model's name, so each switches roles within
its own pool only; the latency targets each process is given. Planned only: nothing is started."""
from __future__ import annotations

from pathlib import Path

import pytest

from services.launcher.config import UpConfig
from services.launcher.main import Stack
from services.launcher.main import main as duet_up
from services.planner.scrape import gateway_figures


def planned(tmp_path: Path, *argv: str) -> dict[str, list[str]]:
    a, b = tmp_path / "model-a", tmp_path / "model-b"
    cfg = UpConfig.from_argv(["--redis-url", "redis://127.0.0.1:1", "--model", str(a), "--model", str(b),
                              "--insecure", *argv, "--", "--device", "cpu"], env={})
    stack = Stack(cfg, tmp_path)
    try:
        stack.plan([str(a), str(b)])
        return {c.name: c.argv for c in stack.children}
    finally:
        stack.secrets.close()


def flag(argv: list[str], name: str) -> list[str]:
    return [argv[i + 1] for i, x in enumerate(argv) if x == name]


def test_a_pool_per_model_behind_one_router_and_gateway(tmp_path):
    children = planned(tmp_path, "--planner", "off", "--prefill", "1", "--decode", "2")
    workers = {name: argv for name, argv in children.items() if "worker" in argv}
    assert {name: flag(argv, "--model")[0].rsplit("/", 1)[1] for name, argv in workers.items()} == {
        "prefill-0": "model-a", "decode-0": "model-a", "decode-1": "model-a",
        "m1-prefill-0": "model-b", "m1-decode-0": "model-b", "m1-decode-1": "model-b"}
    assert sum("router" in argv for argv in children.values()) == 1
    gateway = children["gateway"]
    assert (flag(gateway, "--model"), flag(gateway, "--extra-model")) == (
        [str(tmp_path / "model-a")], [str(tmp_path / "model-b")])
    assert not any("planner" in argv for argv in children.values())


def test_with_the_planner_each_model_gets_its_own(tmp_path):
    children = planned(tmp_path)  # the planner on: duet up's default
    planners = {name: argv for name, argv in children.items() if "planner" in argv}
    assert {name: flag(argv, "--model") for name, argv in planners.items()} == {
        "planner": ["model-a"], "planner-m1": ["model-b"]}
    assert {name for name, argv in children.items() if "--switchable" in argv} == {
        "worker-0", "worker-1", "m1-worker-0", "m1-worker-1"}


def test_both_targets_reach_every_worker_and_planner_and_the_itl_one_the_router(tmp_path):
    """The workers' step budget weighs both (shared/perf_model/step_budget.py)."""
    children = planned(tmp_path, "--slo-ttft-ms", "800", "--slo-itl-ms", "15")
    for name, argv in children.items():
        if "worker" in argv or "planner" in argv:
            assert (flag(argv, "--slo-ttft-ms"), flag(argv, "--slo-itl-ms")) == (["800"], ["15"]), name
    router = next(argv for argv in children.values() if "router" in argv)
    assert (flag(router, "--slo-ttft-ms"), flag(router, "--slo-itl-ms")) == ([], ["15"])


def test_the_planner_of_one_model_reads_that_models_figures():
    page = ("duet_time_to_first_token_seconds_count{endpoint=\"chat_completions\",model=\"a\"} 3.0\n"
            "duet_time_to_first_token_seconds_count{endpoint=\"chat_completions\",model=\"b\"} 5.0\n")
    assert (gateway_figures(page)["ttft_count"], gateway_figures(page, "a")["ttft_count"],
            gateway_figures(page, "b")["ttft_count"]) == (8.0, 3.0, 5.0)


def test_two_folders_of_one_name_are_refused(tmp_path, capsys):
    for side in ("x", "y"):
        (tmp_path / side / "m").mkdir(parents=True)
        (tmp_path / side / "m" / "config.json").write_text("{}")
    assert duet_up(["--port", "1", "--model", str(tmp_path / "x" / "m"), "--model", str(tmp_path / "y" / "m")]) == 2
    assert "same name" in capsys.readouterr().err


def test_several_models_refuse_one_served_name():
    with pytest.raises(SystemExit):
        UpConfig.from_argv(["--model", "/a", "--model", "/b", "--", "--served-model-name", "x"], env={})


@pytest.mark.parametrize("argv, env, overflow", [
    ((), None, True),                                      # the planner on (the default): overflow with it
    (("--planner", "off"), None, False),                   # fixed roles stay as configured
    (("--planner", "off"), "true", True),                  # auto leaves the router's own variable to it
    ((), "false", False),
    (("--planner", "off", "--placement-overflow", "on"), "false", True),  # a value given to duet up wins
    (("--placement-overflow", "off"), "true", False),
])
def test_the_router_places_by_overflow_where_the_planner_runs(tmp_path, monkeypatch, argv, env, overflow):
    """A decode worker prefills long prompts while the prefill workers are past the first-token
    target (services/router/placement.py): `duet up` turns it on with the planner. The router's
    arguments read by its own parser, with the environment it inherits from duet up."""
    from services.router.config import RouterConfig

    if env is None:
        monkeypatch.delenv("DUET_PLACEMENT_OVERFLOW", raising=False)
    else:
        monkeypatch.setenv("DUET_PLACEMENT_OVERFLOW", env)
    router = next(argv for argv in planned(tmp_path, *argv).values() if "router" in argv)
    inherited = {"DUET_PLACEMENT_OVERFLOW": env} if env is not None else {}
    assert RouterConfig.from_argv(router[router.index("router") + 1:], env=inherited).weights.overflow is overflow
