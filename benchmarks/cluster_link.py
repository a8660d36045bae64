"""The emulated cluster's links measured (``fsdp_shell.cluster``), as a rank of each node sees them.

Run as root: ``python benchmarks/cluster_link.py [--rate 400] [--mbytes 8]``. Prints the inter- and
intra-node bandwidth of a large send and of a 1 MB one, the round trip of one float32 inside a
node and across the link, and a one-element all-reduce of all four ranks, beside the ``tbf``
shaping they were measured under (``Link``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fsdp_shell.cluster import Link, cluster_available, run_on_cluster

__all__ = ["main"]

_MB = 1_000_000


def _probe(rank: int, world: int, nbytes: int) -> dict[tuple[str, int], float]:
    """Median seconds, measured on rank 0: ``("send", peer)`` for ``nbytes`` sent to ``peer``
    and one element sent back (rank 1 is on node 0, rank ``world // 2`` on node 1),
    ``("send 1MB", world // 2)`` likewise for 1 MB, ``("ping", peer)`` for one element there
    and back, ``("all_reduce", world)`` for a one-element all-reduce of all ranks."""
    torch.set_num_threads(1)
    other = world // 2
    out: dict[tuple[str, int], float] = {}

    def round_trips(key: tuple[str, int], peer: int, numel: int, reps: int) -> None:
        payload, ack = torch.zeros(numel), torch.zeros(1)
        times = []
        for _ in range(reps + 1):  # the first is a warm-up
            dist.barrier()
            if rank == 0:
                start = time.perf_counter()
                dist.send(payload, peer)
                dist.recv(ack, peer)
                times.append(time.perf_counter() - start)
            elif rank == peer:
                dist.recv(payload, 0)
                dist.send(ack, 0)
        if rank == 0:
            out[key] = statistics.median(times[1:])

    round_trips(("send", 1), 1, nbytes // 4, 5)
    round_trips(("send", other), other, nbytes // 4, 5)
    round_trips(("send 1MB", other), other, _MB // 4, 9)
    round_trips(("ping", 1), 1, 1, 99)
    round_trips(("ping", other), other, 1, 99)
    one = torch.ones(1)
    times = []
    for _ in range(200):
        start = time.perf_counter()
        dist.all_reduce(one)
        times.append(time.perf_counter() - start)
    out[("all_reduce", world)] = statistics.median(times[20:])
    return out


def main() -> None:
    """The self-check's command line (module docstring)."""
    parser = argparse.ArgumentParser(prog="python benchmarks/cluster_link.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=400.0, help="inter-node rate, Mbit/s (default 400)")
    parser.add_argument("--mbytes", type=float, default=8.0, help="bytes per timed send, MB (default 8)")
    args = parser.parse_args()
    if (reason := cluster_available()) is not None:
        sys.exit(f"emulated cluster unavailable: {reason}")
    link = Link.at(args.rate)
    nbytes = int(args.mbytes * _MB)
    t = run_on_cluster(_probe, nbytes, rate_mbit=args.rate, timeout=300.0)[0]
    print(
        f"emulated cluster, 2 nodes x 2 ranks; inter-node tbf rate {link.rate_mbit:g} Mbit/s, "
        f"burst {link.burst_bytes} B, latency {link.latency_ms:g} ms"
    )
    mb = f"{args.mbytes:g} MB"
    rows = [
        (f"inter-node bandwidth, {mb} rank 0 -> 2", nbytes / t[("send", 2)] / _MB, "MB/s"),
        (f"intra-node bandwidth, {mb} rank 0 -> 1", nbytes / t[("send", 1)] / _MB, "MB/s"),
        ("inter-node bandwidth, 1 MB rank 0 -> 2", _MB / t[("send 1MB", 2)] / _MB, "MB/s"),
        ("inter-node round trip, one float32", t[("ping", 2)] * 1e6, "us"),
        ("intra-node round trip, one float32", t[("ping", 1)] * 1e6, "us"),
        ("all_reduce of one float32, 4 ranks", t[("all_reduce", 4)] * 1e6, "us"),
    ]
    for label, value, unit in rows:
        print(f"{label:<40} {value:9.1f} {unit}")
    print(
        f"(the rate counts Ethernet/IP/TCP headers: TCP payload gets ~{link.rate_mbit * 1448 / 1514 / 8:.1f} MB/s "
        f"at MTU 1500; the first {link.burst_bytes} B after idle pass unshaped)"
    )


if __name__ == "__main__":
    main()
