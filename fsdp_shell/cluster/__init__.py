"""An emulated two-node cluster on one machine: gloo ranks in two network namespaces whose only
link is a rate-limited veth pair (needs root and iproute2). The benchmarks of multi-node
training and the tests of multi-node launching run on it.

Usage (``fn`` at the top level of a module, so that it pickles)::

    from fsdp_shell.cluster import cluster_available, node_of, run_on_cluster

    def step(rank: int, world: int, arg: int) -> float:
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        ...                                                 # shard groups are intra-node

    if (reason := cluster_available()) is not None:
        sys.exit(f"no emulated cluster: {reason}")
    times = run_on_cluster(step, 10, rate_mbit=400.0, ranks_per_node=2)

The nodes, their link and their lifetime are ``nodes``' (``nodes()`` gives them to a launcher
of one's own, such as ``torchrun`` in each node through ``start_in``); ``run_on_cluster`` is
``run``'s. Its links measured: ``python benchmarks/cluster_link.py [--rate 400]``.
"""

from fsdp_shell.cluster.nodes import (
    ADDRESSES,
    IFNAME,
    IMPORT_ROOT,
    NODES,
    PORT,
    Link,
    cluster_available,
    node_of,
    nodes,
    start_in,
)
from fsdp_shell.cluster.run import run_on_cluster

__all__ = [
    "ADDRESSES",
    "IFNAME",
    "IMPORT_ROOT",
    "NODES",
    "PORT",
    "Link",
    "cluster_available",
    "node_of",
    "nodes",
    "run_on_cluster",
    "start_in",
]
