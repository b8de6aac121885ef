"""The pod network: a node namespace holding a Linux bridge (like the bridge CNI's cni0),
and one veth pair per pod, its pod end renamed eth0 inside the pod's namespace."""
from __future__ import annotations

import ipaddress
import itertools
from dataclasses import dataclass, field

from tests.helpers.k8s_sim import netns

POD_CIDR = ipaddress.ip_network("10.244.0.0/24")
SERVICE_CIDR = ipaddress.ip_network("10.96.0.0/24")


@dataclass
class PodNetwork:
    prefix: str  # unique per run: namespace names start with it
    node_ns: str = ""
    node_ip: str = str(POD_CIDR.network_address + 1)
    _free_ips: list = field(default_factory=list)
    _veth_ids: itertools.count = field(default_factory=lambda: itertools.count(1))
    namespaces: list[str] = field(default_factory=list)

    def __post_init__(self):
        self.node_ns = f"{self.prefix}node"
        self._free_ips = [str(a) for a in list(POD_CIDR.hosts())[1:]]

    def up(self) -> None:
        netns.add(self.node_ns)
        self.namespaces.append(self.node_ns)
        netns.ip("link", "add", "cni0", "type", "bridge", ns=self.node_ns)
        netns.ip("addr", "add", f"{self.node_ip}/{POD_CIDR.prefixlen}", "dev", "cni0", ns=self.node_ns)
        netns.ip("link", "set", "cni0", "up", ns=self.node_ns)
        # Service IPs are virtual: DNAT rewrites them before the packet leaves a namespace,
        # but the routing lookup that comes first needs a route to exist.
        netns.ip("route", "add", str(SERVICE_CIDR), "dev", "cni0", ns=self.node_ns)

    def add_pod(self, ns: str) -> str:
        """A namespace for a pod, on the bridge; returns its IP."""
        ip_addr = self._free_ips.pop(0)
        veth = f"veth{next(self._veth_ids)}"
        netns.add(ns)
        self.namespaces.append(ns)
        netns.ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns, ns=self.node_ns)
        netns.ip("link", "set", veth, "master", "cni0", "up", ns=self.node_ns)
        netns.ip("addr", "add", f"{ip_addr}/{POD_CIDR.prefixlen}", "dev", "eth0", ns=ns)
        netns.ip("link", "set", "eth0", "up", ns=ns)
        netns.ip("route", "add", "default", "via", self.node_ip, ns=ns)
        return ip_addr

    def remove_pod(self, ns: str) -> None:
        netns.delete(ns)  # its veth pair goes with it
        if ns in self.namespaces:
            self.namespaces.remove(ns)

    def down(self) -> None:
        for ns in reversed(self.namespaces):
            netns.delete(ns)
        self.namespaces.clear()
