"""A pod's resources, as the kubelet sets them: a cgroup per pod with limits.memory as its
memory limit (the kernel OOM-kills past it, page cache reclaimed first, as on a node) and
requests.cpu as its CPU weight. cgroup v1 (memory and cpu controllers mounted under
/sys/fs/cgroup/<controller>) or v2 (a unified hierarchy with the memory controller)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
GROUP = "duet-k8s-sim"


def version() -> int | None:
    if os.access(ROOT / "memory" / "memory.limit_in_bytes", os.W_OK) or (ROOT / "memory" / "cgroup.procs").exists():
        return 1
    controllers = ROOT / "cgroup.controllers"
    if controllers.exists() and "memory" in controllers.read_text().split():
        return 2
    return None


@dataclass
class PodCgroup:
    name: str
    memory_limit: int | None  # bytes
    cpu_milli: int | None

    @property
    def dirs(self) -> list[Path]:
        if version() == 1:
            return [ROOT / c / GROUP / self.name for c in ("memory", "cpu") if (ROOT / c).is_dir()]
        return [ROOT / GROUP / self.name]

    def create(self) -> "PodCgroup":
        v = version()
        if v is None:
            raise RuntimeError("no writable cgroup memory controller (v1 /sys/fs/cgroup/memory or v2 with "
                               "'memory' in cgroup.controllers): pod memory limits cannot be applied")
        if v == 2:  # children of our group may use memory and cpu
            (ROOT / GROUP).mkdir(exist_ok=True)
            subtree = ROOT / "cgroup.subtree_control"
            for c in ("memory", "cpu"):
                if c in (ROOT / "cgroup.controllers").read_text().split():
                    subtree.write_text(f"+{c}")
                    (ROOT / GROUP / "cgroup.subtree_control").write_text(f"+{c}")
        for d in self.dirs:
            d.mkdir(parents=True, exist_ok=True)
            if v == 1 and d.parts[-3] == "memory" and self.memory_limit:
                (d / "memory.limit_in_bytes").write_text(str(self.memory_limit))
            if v == 1 and d.parts[-3] == "cpu" and self.cpu_milli:
                (d / "cpu.shares").write_text(str(max(2, self.cpu_milli * 1024 // 1000)))
            if v == 2 and self.memory_limit:
                (d / "memory.max").write_text(str(self.memory_limit))
            if v == 2 and self.cpu_milli and (d / "cpu.weight").exists():
                (d / "cpu.weight").write_text(str(max(1, min(10000, 1 + (self.cpu_milli * 1024 // 1000 - 2) * 9999 // 262142))))
        return self

    def add(self, pid: int) -> None:
        for d in self.dirs:
            (d / "cgroup.procs").write_text(str(pid))

    def memory_peak(self) -> int | None:
        for d in self.dirs:
            for f in ("memory.max_usage_in_bytes", "memory.peak"):
                if (d / f).exists():
                    return int((d / f).read_text())
        return None

    def oom_kills(self) -> int:
        for d in self.dirs:
            for f in ("memory.oom_control", "memory.events"):
                if (d / f).exists():
                    for line in (d / f).read_text().splitlines():
                        key, _, val = line.partition(" ")
                        if key == "oom_kill":
                            return int(val)
        return 0

    def remove(self) -> None:
        for d in self.dirs:
            try:
                d.rmdir()
            except OSError:
                pass


def reap_stale(is_stale) -> None:
    """Remove the pod cgroups that a dead run left (`is_stale` tells by name), SIGKILLing
    whatever still runs in them."""
    import signal
    import time
    bases = [ROOT / c / GROUP for c in ("memory", "cpu")] + [ROOT / GROUP]
    stale = [d for base in bases if base.is_dir() for d in base.iterdir() if d.is_dir() and is_stale(d.name)]
    for d in stale:
        for pid in (d / "cgroup.procs").read_text().split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + 5
    while stale and time.monotonic() < deadline:
        for d in list(stale):
            try:
                d.rmdir()
                stale.remove(d)
            except OSError:  # still emptying
                pass
        time.sleep(0.05)


def remove_group() -> None:
    """Our parent group, once no pod cgroup is left in it (another run may still use it)."""
    for base in [ROOT / c / GROUP for c in ("memory", "cpu")] + [ROOT / GROUP]:
        try:
            base.rmdir()
        except OSError:
            pass
