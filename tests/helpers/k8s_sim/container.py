"""Starting a container's process (or an exec in it) inside its pod's namespaces.

`ip netns exec` enters the pod's network namespace and a new mount namespace (binding
/etc/netns/<ns>/hosts over /etc/hosts); `unshare` gives the main process a PID namespace
(it is PID 1 there, with PID 1's signal rules; the exec'd probes and hooks share the
network, mounts and cgroup but not the PID namespace); a short shell prologue then makes the root
filesystem read-only (readOnlyRootFilesystem), mounts the pod's volumes and the image's
content at their paths, changes to the image's WORKDIR and execs the command as the
pod's user (runAsUser/runAsGroup, fsGroup as a supplementary group) with every
capability dropped (capabilities.drop: [ALL]) and no_new_privs
(allowPrivilegeEscalation: false). Host paths the image stands in for that sit under a
folder others cannot enter (a Python under /root/.pyenv, a checkout under /root) are
made reachable inside the container only: a tmpfs over that folder with just those
paths bound back in.
"""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path


def blocked_ancestor(path: str) -> str | None:
    """The outermost folder on the way to `path` that others may not enter, if any."""
    parts = os.path.abspath(path).split(os.sep)[1:]
    current = ""
    for part in parts:
        current += os.sep + part
        try:
            if not os.stat(current).st_mode & 0o001:
                return current
        except OSError:
            return None
    return None


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
    user: tuple[int, int, list[int]] | None = None  # uid, gid, supplementary groups; None: stay root
    expose: list[str] = field(default_factory=list)  # host paths the user must reach (see above)
    stage_dir: str = ""  # a host folder for staging `expose` binds

    def _expose_lines(self) -> list[str]:
        lines, by_ancestor = [], {}
        for path in self.expose:
            anc = blocked_ancestor(path)
            if anc is not None:
                by_ancestor.setdefault(anc, []).append(path)
        i = 0
        for anc, paths in by_ancestor.items():
            staged = []
            for path in paths:
                stage = os.path.join(self.stage_dir, str(i))
                os.makedirs(stage, exist_ok=True)
                lines.append(f"mount --bind {shlex.quote(path)} {shlex.quote(stage)}")
                staged.append((stage, path))
                i += 1
            lines.append(f"mount -t tmpfs -o mode=755 tmpfs {shlex.quote(anc)}")
            for stage, path in staged:
                lines.append(f"mkdir -p {shlex.quote(path)}")
                lines.append(f"mount --bind {shlex.quote(stage)} {shlex.quote(path)}")
        return lines

    def _shadowed(self) -> list[str]:
        """Host paths the image stands in for that a volume's mount point would hide (a
        checkout or venv under /tmp, where the manifests mount an emptyDir)."""
        return [p for p in self.expose
                if any((os.path.abspath(p) + "/").startswith(m.path.rstrip("/") + "/") for m in self.mounts)]

    def prologue(self) -> str:
        lines = ["set -e"]
        shadowed = [(os.path.join(self.stage_dir, f"shadow{i}"), p) for i, p in enumerate(self._shadowed())]
        for stage, path in shadowed:  # set aside before the volumes cover them, bound back after
            os.makedirs(stage, exist_ok=True)
            lines.append(f"mount --bind {shlex.quote(path)} {shlex.quote(stage)}")
        for m in self.mounts:
            dst = shlex.quote(m.path)
            if m.source is None:
                opts = "mode=1777" + (f",size={m.size}" if m.size else "")
                lines.append(f"mount -t tmpfs -o {opts} tmpfs {dst}")
            else:
                lines.append(f"mount --bind {shlex.quote(m.source)} {dst}")
                if m.read_only:
                    lines.append(f"mount -o remount,bind,ro {dst}")
        for stage, path in shadowed:
            lines.append(f"mkdir -p {shlex.quote(path)}")
            lines.append(f"mount --bind {shlex.quote(stage)} {shlex.quote(path)}")
        if self.user is not None:
            lines += self._expose_lines()
        if self.read_only_root:  # last: a bind mount made from a read-only mount would be read-only too
            lines.append("mount -o remount,bind,ro /")
        lines.append(f"cd {shlex.quote(self.workdir)}")
        setpriv = ["setpriv"]
        if self.user is not None:
            uid, gid, groups = self.user
            setpriv += [f"--reuid={uid}", f"--regid={gid}",
                        f"--groups={','.join(map(str, groups))}" if groups else "--clear-groups"]
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
