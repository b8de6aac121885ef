"""Starting a container's process (or an exec in it) inside its pod's namespaces.

`ip netns exec` enters the pod's network namespace and a new mount namespace (binding
/etc/netns/<ns>/hosts over /etc/hosts); `unshare` gives the main process a PID namespace
(it is PID 1 there, with PID 1's signal rules; the exec'd probes and hooks share the
network, mounts and cgroup but not the PID namespace); a short shell prologue then makes the root
filesystem read-only (readOnlyRootFilesystem), mounts the pod's volumes and the image's
content at their paths, changes to the image's WORKDIR and execs the command with every
capability dropped (capabilities.drop: [ALL]) and no_new_privs
(allowPrivilegeEscalation: false). The process keeps this host's uid: the interpreter may
live under a root-only home, so runAsUser is not applied.
"""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Mount:
    path: str            # inside the container
    source: str | None   # host folder; None: a tmpfs
    read_only: bool = False
    size: str | None = None  # tmpfs size (emptyDir medium: Memory, sizeLimit)


@dataclass
class ContainerSpec:
    name: str
    netns: str
    env: dict[str, str]
    workdir: str
    mounts: list[Mount]
    read_only_root: bool
    drop_all_caps: bool
    no_new_privs: bool
    cgroup_dirs: list[str] = field(default_factory=list)  # joined before anything runs (cgroups.py)

    def prologue(self) -> str:
        lines = ["set -e"]
        for m in self.mounts:
            dst = shlex.quote(m.path)
            if m.source is None:
                opts = "mode=1777" + (f",size={m.size}" if m.size else "")
                lines.append(f"mount -t tmpfs -o {opts} tmpfs {dst}")
            else:
                lines.append(f"mount --bind {shlex.quote(m.source)} {dst}")
                if m.read_only:
                    lines.append(f"mount -o remount,bind,ro {dst}")
        if self.read_only_root:  # last: a bind mount made from a read-only mount would be read-only too
            lines.append("mount -o remount,bind,ro /")
        lines.append(f"cd {shlex.quote(self.workdir)}")
        setpriv = ["setpriv"]
        if self.drop_all_caps:
            setpriv += ["--bounding-set=-all", "--inh-caps=-all"]
        if self.no_new_privs:
            setpriv += ["--no-new-privs"]
        lines.append(f"exec {shutil.which('setpriv')} {' '.join(setpriv[1:])} -- \"$@\"")
        return "\n".join(lines)

    def argv(self, command: list[str], own_pid_namespace: bool = False) -> list[str]:
        for m in self.mounts:  # mounts are made in order: a later source must not sit under an earlier path
            for earlier in self.mounts[: self.mounts.index(m)]:
                if m.source and (m.source + "/").startswith(earlier.path.rstrip("/") + "/"):
                    raise ValueError(f"{m.source} would be hidden by the mount at {earlier.path}: "
                                     f"keep the pods' host folders elsewhere (e.g. under /var/tmp)")
        for m in self.mounts:  # mount points must exist on the (shared, host) root filesystem
            os.makedirs(m.path, exist_ok=True)
        # mount and setpriv are the host's tools, found before the container's PATH applies
        prologue = self.prologue().replace("mount ", f"{shutil.which('mount')} ")
        # The container's main process is PID 1 of a PID namespace of its own, as under a
        # container runtime: a signal without a handler (SIGTERM included) does not reach it.
        pid_ns = ([shutil.which("unshare"), "--pid", "--fork", "--mount-proc", "--kill-child=SIGKILL"]
                  if own_pid_namespace else [])
        argv = [shutil.which("ip"), "netns", "exec", self.netns, *pid_ns, "/bin/sh", "-c", prologue, "sh", *command]
        if self.cgroup_dirs:  # join the pod's cgroups first, so every byte and child is counted
            join = 'n=$1; shift; while [ "$n" -gt 0 ]; do echo $$ > "$1/cgroup.procs"; shift; n=$((n-1)); done; exec "$@"'
            argv = ["/bin/sh", "-c", join, "sh", str(len(self.cgroup_dirs)), *self.cgroup_dirs, *argv]
        return argv

    def start(self, command: list[str], log_path: Path) -> subprocess.Popen:
        with log_path.open("ab") as log:
            return subprocess.Popen(self.argv(command, own_pid_namespace=True), stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=self.env, start_new_session=True)

    def exec(self, command: list[str], timeout: float) -> subprocess.CompletedProcess:
        """`kubectl exec`: a command in the running container's namespaces and environment."""
        try:
            return subprocess.run(self.argv(command), capture_output=True, text=True, env=self.env,
                                  timeout=timeout, start_new_session=True)
        except subprocess.TimeoutExpired as exc:
            return subprocess.CompletedProcess(exc.cmd, 124, exc.stdout or "", f"timed out after {timeout}s")
