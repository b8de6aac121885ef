"""Services, as kube-proxy (iptables mode) and cluster DNS would make them.

A ClusterIP Service gets a virtual IP; each namespace's nat OUTPUT chain DNATs
VIP:port to one ready endpoint (random choice, as kube-proxy's statistic rules), and a
VIP port without ready endpoints is rejected. A headless Service (clusterIP: None) has
no VIP: its name resolves to the ready pods' IPs. Names resolve through the hosts file
of each namespace (name, name.<ns>, name.<ns>.svc, name.<ns>.svc.cluster.local).
Only ready, non-terminating pods are endpoints (publishNotReadyAddresses is honoured).
"""
from __future__ import annotations

from dataclasses import dataclass

from tests.helpers.k8s_sim.network import SERVICE_CIDR
from tests.helpers.k8s_sim.objects import plain_selector, selects

NAT_CHAIN = "DUET-SERVICES"
REJECT_CHAIN = "DUET-SVC-REJECT"


@dataclass
class Service:
    name: str
    namespace: str
    selector: dict
    ports: list[dict]
    cluster_ip: str | None  # None: headless
    publish_not_ready: bool = False

    def endpoints(self, pods) -> list:
        return [p for p in pods if p.namespace == self.namespace and p.ip
                and selects(plain_selector(self.selector), p.labels)
                and not p.terminating and (p.ready or self.publish_not_ready)]


def target_port(port: dict, pod) -> int:
    target = port.get("targetPort", port["port"])
    if isinstance(target, int):
        return target
    if str(target).isdigit():
        return int(target)
    return pod.named_port(str(target))


class ServiceProxy:
    def __init__(self, rendered_services: list[dict]):
        self.services: list[Service] = []
        vip = iter(SERVICE_CIDR.hosts())
        next(vip)
        for s in rendered_services:
            spec = s["spec"]
            headless = spec.get("clusterIP") == "None"
            self.services.append(Service(
                s["metadata"]["name"], s["metadata"].get("namespace", "default"), spec.get("selector") or {},
                spec.get("ports") or [], None if headless else str(next(vip)),
                bool(spec.get("publishNotReadyAddresses"))))

    def get(self, name: str) -> Service:
        return next(s for s in self.services if s.name == name)

    def hosts(self, pods) -> str:
        lines = ["127.0.0.1 localhost", "::1 localhost"]
        for s in self.services:
            names = f"{s.name} {s.name}.{s.namespace} {s.name}.{s.namespace}.svc {s.name}.{s.namespace}.svc.cluster.local"
            ips = [s.cluster_ip] if s.cluster_ip else [p.ip for p in s.endpoints(pods)]
            lines += [f"{ip} {names}" for ip in ips]
        return "\n".join(lines) + "\n"

    def rules(self, pods) -> str:
        """iptables-restore input for the nat and filter chains of every namespace."""
        nat = ["*nat", f":{NAT_CHAIN} - [0:0]"]
        rej = ["*filter", f":{REJECT_CHAIN} - [0:0]"]
        for s in self.services:
            if not s.cluster_ip:
                continue
            eps = s.endpoints(pods)
            for port in s.ports:
                proto = port.get("protocol", "TCP").lower()
                match = f"-d {s.cluster_ip}/32 -p {proto} -m {proto} --dport {port['port']}"
                if not eps:
                    rej.append(f"-A {REJECT_CHAIN} {match} -j REJECT")
                    continue
                for i, ep in enumerate(eps):
                    left = len(eps) - i
                    pick = "" if left == 1 else f"-m statistic --mode random --probability {1.0 / left:.5f} "
                    nat.append(f"-A {NAT_CHAIN} {match} {pick}-j DNAT --to-destination {ep.ip}:{target_port(port, ep)}")
        return "\n".join(nat + ["COMMIT"] + rej + ["COMMIT"]) + "\n"
