"""One pod as the kubelet runs it: network, volumes, cgroup, the container (as the pod's
securityContext says), probes, termination.

Probes follow the kubelet: the startup probe first (readiness and liveness wait for it),
then each probe every periodSeconds (times `period_scale`), readiness flipping after
successThreshold successes / failureThreshold failures. A liveness or startup failure
past its threshold, or a container exiting on its own, is recorded as an event (the
kubelet would restart it; the tests treat any as a failure). Deletion: the pod leaves
its Services at once, the preStop hook runs, then SIGTERM, then SIGKILL when
terminationGracePeriodSeconds (counted from the deletion, preStop included; 2 s more
when preStop ran over) have passed.
"""
from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass

from tests.helpers.k8s_sim import netns
from tests.helpers.k8s_sim.cgroups import PodCgroup
from tests.helpers.k8s_sim.container import ContainerSpec, Mount
from tests.helpers.k8s_sim.podenv import PodFacts, command_line, container_env, parse_quantity
from tests.helpers.k8s_sim.probes import run_probe


@dataclass
class Event:
    t: float  # seconds since the pod was created
    what: str


class Pod:
    def __init__(self, cluster, name: str, namespace: str, labels: dict, annotations: dict, spec: dict | None):
        self.cluster = cluster
        self.name, self.namespace = name, namespace
        self.labels, self.annotations = dict(labels), dict(annotations)
        self.spec = spec  # None: a namespace with an IP and no container (a client standing in for a pod)
        self.netns = f"{cluster.prefix}{len(cluster.all_pods)}"
        self.ip = ""
        self.ready = False
        self.started = False
        self.terminating = False
        self.gone = False
        self.container: ContainerSpec | None = None
        self.cgroup: PodCgroup | None = None
        self.memory_peak: int | None = None  # bytes, the pod cgroup's high-water mark (set when it ends)
        self.oom_kills = 0
        self.popen: subprocess.Popen | None = None
        self.init_pid: int | None = None  # host pid of the container's PID 1
        self.exit_code: int | None = None
        self.killed = False
        self.events: list[Event] = []
        self.t0 = time.monotonic()
        self.dir = cluster.work_dir / name
        self.log_path = self.dir / "container.log"
        self._stop_probes = threading.Event()
        self._threads: list[threading.Thread] = []

    # --- facts ---------------------------------------------------------------------------

    def event(self, what: str) -> None:
        self.events.append(Event(round(time.monotonic() - self.t0, 2), what))

    def event_time(self, prefix: str) -> float | None:
        return next((e.t for e in self.events if e.what.startswith(prefix)), None)

    @property
    def main_container(self) -> dict:
        containers = self.spec["containers"]
        if len(containers) != 1 or self.spec.get("initContainers"):
            raise NotImplementedError(f"{self.name}: one container and no init containers are modelled")
        return containers[0]

    def named_port(self, name: str) -> int:
        for p in self.main_container.get("ports") or []:
            if p.get("name") == name:
                return int(p["containerPort"])
        raise KeyError(f"{self.name} has no container port named {name}")

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    # --- start ---------------------------------------------------------------------------

    def _volumes(self) -> dict[str, Mount]:
        """Volume name -> how to mount it (the path is filled per volumeMount)."""
        out = {}
        for v in self.spec.get("volumes") or []:
            name, host = v["name"], self.dir / "volumes" / v["name"]
            if "emptyDir" in v:
                ed = v["emptyDir"] or {}
                if ed.get("medium") == "Memory":
                    size = str(int(parse_quantity(ed["sizeLimit"]))) if ed.get("sizeLimit") else None
                    out[name] = Mount("", None, size=size)
                    continue
                host.mkdir(parents=True, exist_ok=True)
                host.chmod(0o777)  # the kubelet makes emptyDirs world-writable
                out[name] = Mount("", str(host))
            elif "configMap" in v or "secret" in v:
                kind, ref = ("ConfigMap", v["configMap"]["name"]) if "configMap" in v else ("Secret", v["secret"]["secretName"])
                host.mkdir(parents=True, exist_ok=True)
                for key, value in self.cluster.objects.config_items(kind, ref).items():
                    (host / key).write_text(value)
                out[name] = Mount("", str(host), read_only=True)
            else:
                raise NotImplementedError(f"{self.name}: volume {name} of type {sorted(set(v) - {'name'})}")
        return out

    def _container_spec(self, image) -> tuple[ContainerSpec, list[str]]:
        c = self.main_container
        facts = PodFacts(self.name, self.namespace, self.ip, self.cluster.node_name, self.cluster.network.node_ip,
                         self.labels, self.annotations, self.spec.get("serviceAccountName", "default"),
                         f"uid-{self.netns}")
        env = container_env(c, facts, self.cluster.objects)
        argv = command_line(c, env, image.entrypoint, image.cmd)
        volumes = self._volumes()
        mounts = []
        for vm in c.get("volumeMounts") or []:
            if vm.get("subPath"):
                raise NotImplementedError("subPath mounts are not modelled")
            base = volumes[vm["name"]]
            mounts.append(Mount(vm["mountPath"], base.source, base.read_only or bool(vm.get("readOnly")), base.size))
        mounted = {m.path for m in mounts}
        mounts += [Mount(path, src, read_only=True) for path, src in image.content.items() if path not in mounted]
        resources = c.get("resources") or {}
        limit = (resources.get("limits") or {}).get("memory")
        cpu = (resources.get("requests") or {}).get("cpu")
        self.cgroup = PodCgroup(self.netns, int(parse_quantity(limit)) if limit else None,
                                int(parse_quantity(cpu) * 1000) if cpu else None).create()
        sc = c.get("securityContext") or {}
        psc = self.spec.get("securityContext") or {}
        uid = sc.get("runAsUser", psc.get("runAsUser", image.user[0] if image.user else None))
        gid = sc.get("runAsGroup", psc.get("runAsGroup", image.user[1] if image.user else uid))
        if (sc.get("runAsNonRoot", psc.get("runAsNonRoot")) and not uid):
            raise RuntimeError(f"{self.name}: runAsNonRoot, but the container would run as root")
        groups = [g for g in [psc.get("fsGroup"), *(psc.get("supplementalGroups") or [])] if g is not None]
        user = (int(uid), int(gid if gid is not None else uid), groups) if uid else None
        if user is not None:  # emptyDirs: the fsGroup owns them, as the kubelet arranges
            for m in mounts:
                if m.source and m.source.startswith(str(self.dir)) and groups:
                    os.chown(m.source, -1, groups[0])
        spec = ContainerSpec(c["name"], self.netns, {**image.env, **env}, c.get("workingDir") or image.workdir, mounts,
                             read_only_root=bool(sc.get("readOnlyRootFilesystem")),
                             drop_all_caps="ALL" in ((sc.get("capabilities") or {}).get("drop") or []),
                             no_new_privs=sc.get("allowPrivilegeEscalation") is False,
                             cgroup_dirs=[str(d) for d in self.cgroup.dirs], user=user,
                             expose=list(image.host_paths), stage_dir=str(self.dir / "stage"))
        return spec, argv

    def start(self, image=None) -> "Pod":
        self.dir.mkdir(parents=True, exist_ok=True)
        self.ip = self.cluster.network.add_pod(self.netns)
        self.cluster.pod_network_ready(self)  # services and policies in place before the container runs
        self.event(f"sandbox ready, ip {self.ip}")
        if self.spec is None:
            return self
        self.container, argv = self._container_spec(image)
        self.argv = argv
        self.popen = self.container.start(argv, self.log_path)
        self.init_pid = self._find_init_pid()
        self.event(f"container started: {argv}")
        t = threading.Thread(target=self._kubelet_loop, name=f"kubelet-{self.name}", daemon=True)
        t.start()
        self._threads.append(t)
        return self

    def _find_init_pid(self) -> int:
        """The host pid of the container's PID 1 (unshare's child)."""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and self.popen.poll() is None:
            try:
                kids = open(f"/proc/{self.popen.pid}/task/{self.popen.pid}/children").read().split()
            except OSError:
                kids = []
            if kids:
                return int(kids[0])
            time.sleep(0.01)
        return self.popen.pid

    # --- probes --------------------------------------------------------------------------

    def _kubelet_loop(self) -> None:
        c = self.main_container
        scale = self.cluster.period_scale
        probes = {k: c[k] for k in ("startupProbe", "readinessProbe", "livenessProbe") if c.get(k)}
        if "startupProbe" not in probes:
            self.started = True
        now = time.monotonic()
        due = {k: now + float(p.get("initialDelaySeconds", 0)) * scale for k, p in probes.items()}
        ok_run = {k: 0 for k in probes}
        fail_run = {k: 0 for k in probes}
        if "readinessProbe" not in probes and self.started:
            self._set_ready(True)
        with netns.entered(self.cluster.network.node_ns):
            while not self._stop_probes.is_set():
                if not self.alive:
                    if not self.terminating:
                        self.exit_code = self.popen.returncode
                        oom = self.cgroup.oom_kills() if self.cgroup else 0
                        self.event(f"container exited on its own with {self.exit_code}"
                                   + (" (OOM-killed: over limits.memory)" if oom else ""))
                        self._set_ready(False)
                    return
                now = time.monotonic()
                for kind, probe in probes.items():
                    if due[kind] > now or (kind != "startupProbe" and not self.started) \
                            or (kind == "startupProbe" and self.started):
                        continue
                    ok, detail = run_probe(probe, self, self.cluster.network.node_ns)
                    if self._stop_probes.is_set():
                        return
                    due[kind] = time.monotonic() + float(probe.get("periodSeconds", 10)) * scale
                    ok_run[kind], fail_run[kind] = (ok_run[kind] + 1, 0) if ok else (0, fail_run[kind] + 1)
                    self._probe_result(kind, probe, ok, detail, ok_run[kind], fail_run[kind])
                self._stop_probes.wait(0.1)

    def _probe_result(self, kind: str, probe: dict, ok: bool, detail: str, oks: int, fails: int) -> None:
        threshold = int(probe.get("failureThreshold", 3))
        if kind == "startupProbe":
            if ok:
                self.started = True
                self.event("started (startup probe passed)")
                if "readinessProbe" not in self.main_container:
                    self._set_ready(True)
            elif fails >= threshold:
                self.event(f"startup probe failed {fails} times ({detail}): the kubelet would restart it")
        elif kind == "readinessProbe":
            if ok and not self.ready and oks >= int(probe.get("successThreshold", 1)):
                self._set_ready(True)
            elif not ok and self.ready and fails >= threshold:
                self.event(f"readiness probe failed ({detail})")
                self._set_ready(False)
        elif kind == "livenessProbe" and not ok and fails >= threshold:
            self.event(f"liveness probe failed {fails} times ({detail}): the kubelet would restart it")

    def _set_ready(self, ready: bool) -> None:
        if ready and self.terminating:  # a probe that was in flight when deletion began
            return
        if ready != self.ready:
            self.ready = ready
            self.event("ready" if ready else "not ready")
            self.cluster.pod_changed()

    # --- termination ---------------------------------------------------------------------

    def delete(self) -> threading.Thread:
        """Begin graceful termination; returns the thread that carries it out."""
        self.terminating = True
        self.event("deletion requested")
        self.ready = False
        self.cluster.pod_changed()  # out of every Service before the hook runs
        t = threading.Thread(target=self._terminate, name=f"terminate-{self.name}", daemon=True)
        t.start()
        self._threads.append(t)
        return t

    def _pre_stop(self, timeout: float) -> None:
        hook = ((self.main_container.get("lifecycle") or {}).get("preStop")) if self.spec else None
        if not hook or not self.alive:
            return
        self.event(f"preStop started: {hook}")
        if "exec" in hook:
            out = self.container.exec(list(hook["exec"]["command"]), timeout)
            self.event(f"preStop finished with exit {out.returncode}")
        elif "sleep" in hook:
            time.sleep(min(float(hook["sleep"]["seconds"]), timeout))
            self.event("preStop finished")
        elif "httpGet" in hook:
            from tests.helpers.k8s_sim.probes import http_get
            with netns.entered(self.cluster.network.node_ns):
                ok, detail = http_get(hook["httpGet"], self, timeout)
            self.event(f"preStop finished: {detail}")
        else:
            raise NotImplementedError(f"preStop {sorted(hook)}")

    def _terminate(self) -> None:
        start = time.monotonic()
        grace = float(self.spec.get("terminationGracePeriodSeconds", 30)) if self.spec else 0.0
        deadline = start + grace
        try:
            self._pre_stop(grace)
            if time.monotonic() >= deadline:  # the kubelet's one-time extension
                deadline = time.monotonic() + 2
            self._stop_probes.set()
            if self.alive:
                try:
                    os.kill(self.init_pid, signal.SIGTERM)  # to the container's PID 1
                except ProcessLookupError:
                    pass
                self.event("SIGTERM sent")
                try:
                    self.popen.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    self.killed = True
                    self.event("grace period over: SIGKILL")
            self._kill_rest()
            if self.popen is not None:
                self.exit_code = self.popen.returncode
                self.event(f"container exited with {self.exit_code}")
        finally:
            self.gone = True
            self.cluster.pod_gone(self)

    def _kill_rest(self) -> None:
        """The runtime kills whatever is left in the container when its main process ends;
        then the pod's cgroup goes (its high-water mark kept)."""
        if self.popen is None:
            return
        pids = {self.popen.pid, self.init_pid or self.popen.pid}
        for d in self.cgroup.dirs if self.cgroup else []:
            try:
                pids |= {int(x) for x in (d / "cgroup.procs").read_text().split()}
            except OSError:
                pass
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        try:
            self.popen.wait(10)
        except subprocess.TimeoutExpired:
            pass
        if self.cgroup is not None:
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and any((d / "cgroup.procs").read_text().strip()
                                                      for d in self.cgroup.dirs if d.exists()):
                time.sleep(0.05)
            self.memory_peak = self.cgroup.memory_peak()
            self.oom_kills = self.cgroup.oom_kills()
            if self.oom_kills:
                self.event(f"OOM-killed {self.oom_kills} times (limits.memory)")
            self.cgroup.remove()

    def memory_high_water(self) -> int | None:
        """Bytes: the pod cgroup's peak so far (or when it ended)."""
        if self.cgroup is not None and not self.gone and self.memory_peak is None:
            return self.cgroup.memory_peak()
        return self.memory_peak

    def force_stop(self) -> None:
        """Teardown: no grace."""
        self._stop_probes.set()
        self.terminating = True
        self._kill_rest()

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def describe(self) -> str:
        state = ("gone" if self.gone else "terminating" if self.terminating else
                 "ready" if self.ready else "running" if self.alive else "not running")
        ev = "\n".join(f"  {e.t:7.2f}s {e.what}" for e in self.events)
        return f"pod {self.name} ({self.ip}, netns {self.netns}, {state}):\n{ev}"
