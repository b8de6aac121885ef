"""A small kubelet/kube-proxy/CNI stand-in that runs rendered k8s manifests as processes.

Each pod gets its own network namespace with an IP on a Linux bridge (that bridge lives in
a "node" namespace of its own, so nothing on the host's network changes); Services get a
virtual IP that each namespace's iptables nat OUTPUT chain DNATs to ready endpoints, as
kube-proxy's iptables mode does, and a per-namespace hosts file (`ip netns exec` binds
/etc/netns/<ns>/hosts over /etc/hosts) stands in for cluster DNS. NetworkPolicies become
iptables filter rules inside each pod's namespace. Containers run the rendered command,
args and env with the host's tools in place of images (image.py says how), as PID 1 of a
PID namespace of their own, as the pod's user, without capabilities, on a read-only
root with their volumes mounted, in a cgroup holding limits.memory.

Modules: objects (rendering, selectors), podenv (env and $(VAR) expansion), image (images
-> host commands), netns (ip/iptables helpers, entering a namespace), network (bridge and
pod interfaces), service_proxy (ClusterIPs, hosts, DNAT), netpol (NetworkPolicy ->
iptables), container (starting a container or an exec in it), cgroups (memory limit
and CPU weight), probes, pod (one pod's lifecycle as the kubelet runs it), cluster
(deployments, scaling, deletion), observe (connections, scrapes, the registry, from a
given pod).
"""
