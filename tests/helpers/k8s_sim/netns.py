"""Network namespaces: `ip`/`iptables` commands in them, and entering one from this process.

`entered(ns)` switches the calling thread into a namespace (setns(2) through libc, as
Python 3.11 has no os.setns) and back: sockets opened inside stay in that namespace, which
is how the test talks to Services and pods as a node-local client would.
"""
from __future__ import annotations

import ctypes
import os
import re
import shutil
import signal
import subprocess
import threading
from contextlib import contextmanager

CLONE_NEWNET = 0x40000000
NETNS_DIR = "/var/run/netns"
_libc = ctypes.CDLL(None, use_errno=True)


def require_capabilities() -> None:
    """Fail with a clear message where this machine cannot run pods in namespaces."""
    problems = []
    if os.geteuid() != 0:
        problems.append(f"not root (euid {os.geteuid()}): network namespaces, veth pairs and iptables need root")
    for tool in ("ip", "iptables", "iptables-restore", "setpriv", "unshare", "mount", "kubectl", "redis-server"):
        if shutil.which(tool) is None:
            problems.append(f"`{tool}` is not on PATH")
    if not problems:
        probe = f"k8sprobe{os.getpid()}"
        out = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
        if out.returncode != 0:
            problems.append(f"`ip netns add` fails here: {out.stderr.strip()}")
        else:
            ipt = subprocess.run(["ip", "netns", "exec", probe, "iptables", "-S"], capture_output=True, text=True)
            if ipt.returncode != 0:
                problems.append(f"iptables inside a network namespace fails: {ipt.stderr.strip()}")
            subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    if problems:
        raise RuntimeError("cannot run the k8s manifests as namespaced processes here:\n  " + "\n  ".join(problems))


def run(*argv: str, ns: str | None = None, input: str | None = None, check: bool = True) -> str:
    cmd = list(argv) if ns is None else ["ip", "netns", "exec", ns, *argv]
    out = subprocess.run(cmd, capture_output=True, text=True, input=input, timeout=30)
    if check and out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}): {out.stderr.strip()}")
    return out.stdout


def ip(*args: str, ns: str | None = None) -> None:
    run("ip", *(["-n", ns] if ns else []), *args)


def add(ns: str) -> None:
    run("ip", "netns", "add", ns)
    ip("link", "set", "lo", "up", ns=ns)


def delete(ns: str) -> None:
    subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)


def iptables_restore(ns: str, rules: str) -> None:
    """Load rules atomically per table; --noflush keeps chains not named in `rules`, and
    naming a chain (':CHAIN - [0:0]') empties it first."""
    run("iptables-restore", "--noflush", ns=ns, input=rules)


def write_hosts(ns: str, text: str) -> None:
    """/etc/netns/<ns>/hosts, which `ip netns exec` binds over /etc/hosts. Rewritten in place
    (same inode) so processes already running see the change."""
    path = f"/etc/netns/{ns}/hosts"
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "a+") as f:
        f.seek(0)
        f.truncate()
        f.write(text)



@contextmanager
def entered(ns: str):
    """Run the body with this thread in network namespace `ns`."""
    own = os.open(f"/proc/self/task/{threading.get_native_id()}/ns/net", os.O_RDONLY)
    target = os.open(f"{NETNS_DIR}/{ns}", os.O_RDONLY)
    try:
        if _libc.setns(target, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {ns}: {os.strerror(err)}")
        try:
            yield
        finally:
            if _libc.setns(own, CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"setns back from {ns}: {os.strerror(err)}")
    finally:
        os.close(own)
        os.close(target)


STALE_NAME = re.compile(r"^k8s(\d+)x\d+-")


def cluster_prefix(instance: int) -> str:
    """Namespace names of one cluster: k8s<pid>x<instance>-..., so a later run can tell
    which ones a dead test process left behind."""
    return f"k8s{os.getpid()}x{instance}-"


def is_stale(name: str) -> bool:
    m = STALE_NAME.match(name)
    return m is not None and not os.path.exists(f"/proc/{m.group(1)}")


def reap_stale() -> list[str]:
    """Delete namespaces (and SIGKILL the processes in them) that a test process which no
    longer exists left behind, e.g. after it was killed."""
    reaped = []
    for line in run("ip", "netns", "list", check=False).splitlines():
        name = line.split()[0] if line.split() else ""
        if not is_stale(name):
            continue
        for pid in run("ip", "netns", "pids", name, check=False).split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        delete(name)
        reaped.append(name)
    return reaped
