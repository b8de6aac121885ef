"""Container images, mapped onto this host: the image's environment, working directory and
entrypoint, and which host folders stand in for the image's own files.

duet:*   is built from k8s/image/Dockerfile; its final stage's ENV/WORKDIR/ENTRYPOINT/CMD
         are read from there. `/opt/duet/venv/bin` (the venv with the `duet` script) becomes
         a folder with a `duet` script that runs this repository's CLI with the test's
         Python; the default model the image converts at build time into /opt/duet/cache is
         the host's converted cache folder, mounted read-only at that path.
redis:*  the host's redis-server and redis-cli (the image's WORKDIR is /data).
otel/opentelemetry-collector:*  tests/helpers/k8s_sim/otel_collector.py, which reads the same
         config file and serves the same receivers and health check.
Anything else is not mapped: the cluster reports such a Deployment as not run.
"""
from __future__ import annotations

import os
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
DOCKERFILE = REPO / "k8s" / "image" / "Dockerfile"
IMAGE_VENV_BIN = "/opt/duet/venv/bin"
IMAGE_MODEL_CACHE = "/opt/duet/cache"


@dataclass
class HostImage:
    name: str
    env: dict[str, str]
    workdir: str
    entrypoint: list[str]
    cmd: list[str]
    content: dict[str, str] = field(default_factory=dict)  # container path -> host folder (read-only)
    user: tuple[int, int] | None = None  # USER; None: root
    host_paths: list[str] = field(default_factory=list)  # host paths its programs run from


def _final_stage(dockerfile: Path) -> list[tuple[str, str]]:
    """(instruction, rest) of the last FROM stage, continuation lines joined."""
    logical, buf = [], ""
    for raw in dockerfile.read_text().splitlines():
        line = raw.rstrip()
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        logical.append(buf + line)
        buf = ""
    stage: list[tuple[str, str]] = []
    for line in logical:
        instr, _, rest = line.strip().partition(" ")
        if instr.upper() == "FROM":
            stage = []
        stage.append((instr.upper(), rest.strip()))
    return stage


def _exec_form(text: str) -> list[str]:
    import json
    return json.loads(text) if text.startswith("[") else ["/bin/sh", "-c", text]


def duet_image(name: str, work_dir: Path, model_cache: Path) -> HostImage:
    """The duet image from its Dockerfile, with the host's Python and model cache."""
    bin_dir = work_dir / "image-duet-bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    script = bin_dir / "duet"
    # The image's console script, here: this repository's CLI under the test's interpreter.
    script.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} -m services.cli \"$@\"\n")
    script.chmod(0o755)
    env: dict[str, str] = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
    workdir, entrypoint, cmd, user = "/", [], [], None
    for instr, rest in _final_stage(DOCKERFILE):
        if instr == "ENV":
            for item in shlex.split(rest):
                key, _, value = item.partition("=")
                value = value.replace("$PATH", env.get("PATH", "")).replace("${PATH}", env.get("PATH", ""))
                env[key] = value
        elif instr == "WORKDIR":
            workdir = rest
        elif instr == "USER":
            uid, _, gid = rest.partition(":")
            user = (int(uid), int(gid or uid))
        elif instr == "ENTRYPOINT":
            entrypoint = _exec_form(rest)
        elif instr == "CMD":
            cmd = _exec_form(rest)
    if IMAGE_VENV_BIN not in env["PATH"].split(":"):
        raise AssertionError(f"the Dockerfile's PATH no longer starts at {IMAGE_VENV_BIN}: update image.py")
    env["PATH"] = env["PATH"].replace(IMAGE_VENV_BIN, f"{bin_dir}:{Path(sys.executable).parent}")
    env["PYTHONPATH"] = str(REPO)  # the image has the package installed; here it is the checkout
    return HostImage(name, env, workdir, entrypoint, cmd, content={IMAGE_MODEL_CACHE: str(model_cache)}, user=user,
                     host_paths=[sys.base_prefix, sys.prefix, str(REPO), str(bin_dir)])


def redis_image(name: str) -> HostImage:
    return HostImage(name, {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}, "/data",
                     ["redis-server"], [])


def otel_collector_image(name: str, work_dir: Path) -> HostImage:
    """The collector's ENTRYPOINT (/otelcol) is tests/helpers/k8s_sim/otel_collector.py here."""
    bin_dir = work_dir / "image-otelcol-bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    script = bin_dir / "otelcol"
    script.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} -m tests.helpers.k8s_sim.otel_collector \"$@\"\n")
    script.chmod(0o755)
    return HostImage(name, {"PATH": f"{bin_dir}:/usr/bin:/bin", "PYTHONPATH": str(REPO), "PYTHONDONTWRITEBYTECODE": "1"},
                     "/", [str(script)], [], user=(10001, 10001),
                     host_paths=[sys.base_prefix, sys.prefix, str(REPO), str(bin_dir)])


def host_image(name: str, work_dir: Path, model_cache: Path) -> HostImage | None:
    repo = name.rsplit(":", 1)[0]
    if repo == "duet" or repo.endswith("/duet"):
        return duet_image(name, work_dir, model_cache)
    if repo == "redis" or repo.endswith("/redis"):
        return redis_image(name)
    if repo.endswith("opentelemetry-collector") or repo.endswith("opentelemetry-collector-contrib"):
        return otel_collector_image(name, work_dir)
    return None
