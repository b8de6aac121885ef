"""`duet loadtest hostile` / `python -m loadtest hostile`: the hostile-client probes.

    python -m loadtest hostile --base-url http://127.0.0.1:8000 --api-key sk-test --gateway-pid auto \
        [--redis-url redis://... | --worker-metrics HOST:PORT ...] [--only 1,2,field_*] [--json F] [--markdown F]

Runs every probe (or those --only names), one after the other from an idle stack, each within
its time limit, and prints a row a probe (status, error JSON, latency, RSS growth, /health
p50/max, victim latency, verdict); loadtest/hostile/README.md says more. Exit 1 on a FAIL."""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
import time

from loadtest.hostile.config import ProbeSizes, SuiteConfig
from loadtest.hostile.probes import all_probes
from loadtest.hostile.report import markdown_table, text_table, write_json
from loadtest.hostile.result import FAIL
from loadtest.hostile.runner import run_suite, select


def _pid(value: str) -> int:
    return 0 if value == "auto" else int(value)


def _list(value: str) -> list[str]:
    return [x.strip() for x in value.split(",") if x.strip()]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="duet loadtest hostile", description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--api-key", default=None, help="sent as Authorization: Bearer KEY")
    p.add_argument("--gateway-pid", type=_pid, default=None,
                   help="the gateway's pid for RSS / CPU readings, or 'auto' (the process listening on the port)")
    p.add_argument("--redis-url", default=None,
                   help="registry to find the decode workers' /metrics (default: the gateway's own --redis-url)")
    p.add_argument("--worker-metrics", action="append", default=[], metavar="HOST:PORT",
                   help="a decode (or both) worker's /metrics address; repeatable (instead of the registry)")
    p.add_argument("--only", type=_list, default=[],
                   help="comma-separated probe names, prefix*, or checklist items (loadtest/hostile/README.md)")
    p.add_argument("--skip", type=_list, default=[], help="the same, to leave out")
    p.add_argument("--list", action="store_true", help="list the probes and exit")
    p.add_argument("--label", default="", help="a word for the report (e.g. split, colocated)")
    p.add_argument("--json", default="loadtest-results/hostile.json", help="where the figures go ('' for nowhere)")
    p.add_argument("--markdown", default=None, help="also write the table as Markdown here")
    sizes = p.add_argument_group("sizes (defaults fit a 2-core CPU box)")
    for f in dataclasses.fields(ProbeSizes):
        flag = "--" + f.name.replace("_", "-")
        if f.name == "bomb_steps_mb":
            sizes.add_argument(flag, type=lambda v: tuple(int(x) for x in _list(v)), default=f.default,
                               help=f"comma-separated (default {','.join(map(str, f.default))})")
        else:
            sizes.add_argument(flag, type=type(f.default), default=f.default, help=f"default {f.default}")
    return p


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    probes = select(all_probes(), a.only, a.skip)
    if a.list:
        for p in probes:
            print(f"{p.name:42} item {p.item:6} expects {p.expect}")
        return 0
    sizes = ProbeSizes(**{f.name: getattr(a, f.name) for f in dataclasses.fields(ProbeSizes)})
    cfg = SuiteConfig(a.base_url, a.api_key, a.gateway_pid, a.redis_url, a.worker_metrics, sizes, a.only, a.skip,
                      a.label)
    started = time.time()
    try:
        results = asyncio.run(run_suite(cfg, probes, log=lambda line: print(line, flush=True)))
    except RuntimeError as exc:
        print(f"duet loadtest hostile: {exc}", file=sys.stderr)
        return 2
    print()
    print(text_table(results))
    meta = {"base_url": a.base_url, "label": a.label, "started": started, "seconds": round(time.time() - started, 1),
            "gateway_pid": cfg.gateway_pid, "sizes": dataclasses.asdict(sizes), "argv": sys.argv[1:] if argv is None
            else argv}
    if a.json:
        write_json(a.json, results, meta)
        print(f"JSON: {a.json}")
    if a.markdown:
        with open(a.markdown, "w") as f:
            f.write(markdown_table(results))
    return 1 if any(r.verdict == FAIL for r in results) else 0
