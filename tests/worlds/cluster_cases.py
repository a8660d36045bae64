"""Functions the emulated-cluster tests run on every rank (``tests/worlds/test_cluster.py``). Kept
apart from the test module, which probes for network namespaces when imported: each rank
imports the module its function lives in."""

from __future__ import annotations

import os
import subprocess
import time

import torch
import torch.distributed as dist


def whoami(rank: int, world: int, arg: None) -> tuple[int, int, str, str, float]:
    """This rank's namespace, the IPv4 address of its veth end, and a world all-reduce of
    the ranks."""
    namespace = subprocess.run(["ip", "netns", "identify"], capture_output=True, text=True, check=True).stdout
    shown = subprocess.run(
        ["ip", "-4", "-o", "addr", "show", "dev", os.environ["GLOO_SOCKET_IFNAME"]],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    address = shown.split("inet ")[1].split("/")[0]
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    return rank, world, namespace.strip(), address, total.item()


def raise_on_rank_1(rank: int, world: int, message: str) -> None:
    """Rank 1 raises ``ValueError(message)``; the others wait for it in a barrier."""
    if rank == 1:
        raise ValueError(message)
    dist.barrier()


def sleep(rank: int, world: int, seconds: float) -> None:
    time.sleep(seconds)
