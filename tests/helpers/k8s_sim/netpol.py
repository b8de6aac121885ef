"""NetworkPolicies as iptables filter rules inside each pod's namespace.

Kubernetes semantics: a pod selected by no policy of a direction is open in that
direction; a selected pod admits only what some rule of some selecting policy allows;
a connection needs the source's egress and the destination's ingress. Rules are written
per peer pod IP (selectors are evaluated against the pods that exist now, and re-applied
whenever pods come or go, as a CNI's policy agent does). Replies ride conntrack. Traffic
from the node (kubelet probes) is admitted, as common CNIs do by default.
"""
from __future__ import annotations

import ipaddress

from tests.helpers.k8s_sim.objects import selects

IN_CHAIN = "DUET-POL-IN"
OUT_CHAIN = "DUET-POL-OUT"


def namespace_labels(namespace: str, rendered_namespaces: list[dict]) -> dict:
    labels = {"kubernetes.io/metadata.name": namespace}
    for ns in rendered_namespaces:
        if ns["metadata"]["name"] == namespace:
            labels.update(ns["metadata"].get("labels") or {})
    return labels


class PolicyAgent:
    def __init__(self, policies: list[dict], rendered_namespaces: list[dict], node_ip: str):
        self.policies = policies
        self.namespaces = rendered_namespaces
        self.node_ip = node_ip

    def _selecting(self, pod, direction: str) -> list[dict]:
        return [p for p in self.policies
                if p["metadata"].get("namespace", "default") == pod.namespace
                and direction in p["spec"].get("policyTypes", ["Ingress"])
                and selects(p["spec"].get("podSelector") or {}, pod.labels)]

    def _peer_ips(self, peer: dict, policy_ns: str, pods) -> list[str]:
        if "ipBlock" in peer:
            if peer["ipBlock"].get("except"):
                raise NotImplementedError("ipBlock.except is not modelled")
            return [str(ipaddress.ip_network(peer["ipBlock"]["cidr"]))]
        ns_sel, pod_sel = peer.get("namespaceSelector"), peer.get("podSelector")
        out = []
        for p in pods:
            if not p.ip:
                continue
            if ns_sel is None:
                in_ns = p.namespace == policy_ns
            else:
                in_ns = selects(ns_sel, namespace_labels(p.namespace, self.namespaces))
            if in_ns and (pod_sel is None or selects(pod_sel, p.labels)):
                out.append(p.ip)
        return out

    @staticmethod
    def _port_matches(ports: list[dict] | None, port_owner) -> list[str]:
        """iptables match fragments for a rule's ports (one per port entry; [''] = any)."""
        if not ports:
            return [""]
        out = []
        for p in ports:
            proto = p.get("protocol", "TCP").lower()
            if "port" not in p:
                out.append(f"-p {proto}")
                continue
            port = p["port"]
            if not isinstance(port, int) and not str(port).isdigit():
                if port_owner is None:
                    raise NotImplementedError(f"named port {port} in a rule without peers")
                port = port_owner.named_port(str(port))
            span = f"{port}:{p['endPort']}" if p.get("endPort") else str(port)
            out.append(f"-p {proto} -m {proto} --dport {span}")
        return out

    def _direction(self, pod, pods, direction: str) -> list[str]:
        chain, peer_flag, key, peers_key = ((IN_CHAIN, "-s", "ingress", "from") if direction == "Ingress"
                                            else (OUT_CHAIN, "-d", "egress", "to"))
        lines = [f"-A {chain} -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT",
                 f"-A {chain} {'-i' if direction == 'Ingress' else '-o'} lo -j ACCEPT"]
        if direction == "Ingress":
            lines.append(f"-A {chain} -s {self.node_ip}/32 -j ACCEPT")  # kubelet probes
        policies = self._selecting(pod, direction)
        if not policies:
            return lines + [f"-A {chain} -j ACCEPT"]
        by_ip = {p.ip: p for p in pods if p.ip}
        for policy in policies:
            policy_ns = policy["metadata"].get("namespace", "default")
            for rule in policy["spec"].get(key) or []:
                peers = rule.get(peers_key)
                targets = [None] if not peers else sorted({ip for peer in peers
                                                           for ip in self._peer_ips(peer, policy_ns, pods)})
                for target in targets:
                    # a named port is the destination pod's: ours for ingress, the peer's for egress
                    owner = pod if direction == "Ingress" else by_ip.get(target)
                    for ports in self._port_matches(rule.get("ports"), owner):
                        where = f"{peer_flag} {target if '/' in str(target) else f'{target}/32'} " if target else ""
                        lines.append(f"-A {chain} {where}{ports} -j ACCEPT".replace("  ", " "))
        return lines + [f"-A {chain} -j DROP"]

    def rules(self, pod, pods) -> str:
        """iptables-restore input for one pod's namespace."""
        body = ["*filter", f":{IN_CHAIN} - [0:0]", f":{OUT_CHAIN} - [0:0]"]
        body += self._direction(pod, pods, "Ingress") + self._direction(pod, pods, "Egress")
        return "\n".join(body + ["COMMIT"]) + "\n"
