"""The cluster: renders an overlay and runs its Deployments as pods (pod.py), keeping
Service routing (service_proxy.py) and NetworkPolicy rules (netpol.py) in step with the
pods, as the endpoints controller, kube-proxy and a CNI's policy agent would.

Objects created beside the manifests (the Secrets they mount and never render, made by
`kubectl create secret` or `duet k8s-secrets`) are passed in as `secrets`.

Deployments act through a ReplicaSet-like loop: the pod count follows `replicas`; a
deleted pod is replaced at once; scaling down removes not-ready pods first, then the
newest. A Deployment whose image has no host mapping (image.py) is not run and listed
in `not_run`.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import secrets
import threading
from pathlib import Path

from tests.helpers.k8s_sim import cgroups, netns
from tests.helpers.k8s_sim.image import HostImage, host_image
from tests.helpers.k8s_sim.netpol import IN_CHAIN, OUT_CHAIN, PolicyAgent
from tests.helpers.k8s_sim.network import PodNetwork
from tests.helpers.k8s_sim.objects import Objects, render, selects
from tests.helpers.k8s_sim.pod import Pod
from tests.helpers.k8s_sim.service_proxy import NAT_CHAIN, REJECT_CHAIN, ServiceProxy

_instances = itertools.count()
_SUFFIX_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"  # the apiserver's generateName alphabet


def _bootstrap(pod_chains: bool) -> str:
    filt = ["*filter", f":{REJECT_CHAIN} - [0:0]", f"-A OUTPUT -j {REJECT_CHAIN}"]
    if pod_chains:
        filt[2:2] = [f":{IN_CHAIN} - [0:0]", f":{OUT_CHAIN} - [0:0]"]
        filt += [f"-A INPUT -j {IN_CHAIN}", f"-A OUTPUT -j {OUT_CHAIN}"]
    return "\n".join(["*nat", f":{NAT_CHAIN} - [0:0]", f"-A OUTPUT -j {NAT_CHAIN}", "COMMIT", *filt, "COMMIT"]) + "\n"


class Cluster:
    def __init__(self, overlay: str, work_dir: Path, model_cache: Path, period_scale: float = 1.0,
                 secrets: list[dict] = ()):
        netns.require_capabilities()
        self.objects = Objects(render(overlay) + list(secrets))
        netns.reap_stale()
        cgroups.reap_stale(netns.is_stale)
        self.prefix = netns.cluster_prefix(next(_instances))
        self.work_dir = Path(work_dir)
        self.model_cache = Path(model_cache)
        self.period_scale = period_scale
        self.node_name = "sim-node"
        self.network = PodNetwork(self.prefix)
        self.proxy = ServiceProxy(self.objects.of_kind("Service"))
        self.policies = PolicyAgent(self.objects.of_kind("NetworkPolicy"), self.objects.of_kind("Namespace"),
                                    self.network.node_ip)
        self.all_pods: list[Pod] = []
        self.replicas: dict[str, int] = {}
        self.images: dict[str, HostImage] = {}
        self.not_run: dict[str, str] = {}
        self._lock = threading.RLock()
        self._down = False  # down() ran: the namespaces are gone, nothing more to route

    # --- views ---------------------------------------------------------------------------

    @property
    def pods(self) -> list[Pod]:
        """Pods that exist (terminating ones included), as `kubectl get pods` lists them."""
        return [p for p in self.all_pods if not p.gone]

    def deployment(self, name: str) -> dict:
        return self.objects.get("Deployment", name)

    def pods_of(self, deployment: str, include_terminating: bool = False) -> list[Pod]:
        selector = self.deployment(deployment)["spec"]["selector"]
        return [p for p in self.pods if p.spec is not None and p.namespace == self.deployment(deployment)["metadata"]["namespace"]
                and selects(selector, p.labels) and (include_terminating or not p.terminating)]

    def pod(self, name: str) -> Pod:
        return next(p for p in self.all_pods if p.name == name)

    def service_ip(self, name: str) -> str:
        ip = self.proxy.get(name).cluster_ip
        if ip is None:
            raise ValueError(f"Service {name} is headless")
        return ip

    # --- lifecycle -----------------------------------------------------------------------

    def up(self) -> "Cluster":
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.work_dir.chmod(0o755)  # pods running as other users reach their image's scripts here
        self.network.up()
        netns.iptables_restore(self.network.node_ns, _bootstrap(pod_chains=False))
        for dep in self.objects.of_kind("Deployment"):
            name = dep["metadata"]["name"]
            image_name = dep["spec"]["template"]["spec"]["containers"][0]["image"]
            image = host_image(image_name, self.work_dir, self.model_cache)
            if image is None:
                self.not_run[name] = image_name
                continue
            self.images[name] = image
            self.replicas[name] = int(dep["spec"].get("replicas", 1))
        with self._lock:
            for name in self.replicas:
                self._sync(name)
        return self

    def bare_pod(self, name: str, namespace: str, labels: dict) -> Pod:
        """A namespace with an IP and labels but no container: a client that policies can
        name (e.g. a Prometheus pod in namespace `monitoring`)."""
        with self._lock:
            pod = Pod(self, name, namespace, labels, {}, None)
            self.all_pods.append(pod)
            return pod.start()

    def _new_pod(self, deployment: str) -> Pod:
        dep = self.deployment(deployment)
        template = dep["spec"]["template"]
        digest = hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()
        template_hash = "".join(_SUFFIX_ALPHABET[int(c, 16) % len(_SUFFIX_ALPHABET)] for c in digest[:10])
        name = f"{deployment}-{template_hash}-{''.join(secrets.choice(_SUFFIX_ALPHABET) for _ in range(5))}"
        labels = {**(template["metadata"].get("labels") or {}), "pod-template-hash": template_hash}
        pod = Pod(self, name, dep["metadata"].get("namespace", "default"), labels,
                  template["metadata"].get("annotations") or {}, template["spec"])
        self.all_pods.append(pod)
        return pod.start(self.images[deployment])

    def _sync(self, deployment: str) -> None:
        """The ReplicaSet's loop: as many live pods as replicas."""
        live = self.pods_of(deployment)
        want = self.replicas[deployment]
        for _ in range(want - len(live)):
            self._new_pod(deployment)
        if len(live) > want:
            victims = sorted(live, key=lambda p: (p.ready, -p.t0))[: len(live) - want]
            for p in victims:
                p.delete()

    def scale(self, deployment: str, replicas: int) -> None:
        """`kubectl scale deploy/<name> --replicas=N`."""
        with self._lock:
            self.replicas[deployment] = replicas
            self._sync(deployment)

    def delete_pod(self, pod: Pod) -> threading.Thread:
        """`kubectl delete pod <name> --wait=false`: graceful termination; its ReplicaSet
        creates a replacement at once."""
        with self._lock:
            t = pod.delete()
            owner = next((d for d in self.replicas if pod in self.pods_of(d, include_terminating=True)), None)
            if owner:
                self._sync(owner)
            return t

    # --- routing and policy, kept in step with the pods ----------------------------------------

    def pod_network_ready(self, pod: Pod) -> None:
        netns.iptables_restore(pod.netns, _bootstrap(pod_chains=True))
        self.reconcile()

    def pod_changed(self) -> None:
        self.reconcile()

    def pod_gone(self, pod: Pod) -> None:
        with self._lock:
            if self._down:
                return
            self.network.remove_pod(pod.netns)
            self.reconcile()

    def reconcile(self) -> None:
        with self._lock:
            if self._down:  # a kubelet thread's late probe result, queued behind down()
                return
            pods = [p for p in self.pods if p.ip]
            hosts = self.proxy.hosts(pods)
            service_rules = self.proxy.rules(pods)
            for ns in [self.network.node_ns] + [p.netns for p in pods]:
                netns.write_hosts(ns, hosts)
                netns.iptables_restore(ns, service_rules)
            for p in pods:
                netns.iptables_restore(p.netns, self.policies.rules(p, pods))

    def down(self) -> None:
        with self._lock:
            self._down = True
            for p in self.all_pods:
                p.force_stop()
            self.network.down()
            cgroups.remove_group()

    def describe(self, log_lines: int = 30) -> str:
        parts = [f"work dir {self.work_dir}; not run (image not mapped): {self.not_run}"]
        for p in self.all_pods:
            parts.append(p.describe())
            if p.spec is not None:
                parts.append(f"----- log of {p.name} -----\n{p.log_tail(log_lines)}")
        return "\n".join(parts)
