"""Run a function on every rank of a local world of processes, with a hard timeout.

``run_world(n, fn, arg)`` starts ``n`` processes (forked from a server that has imported torch
and this library once: ``world_context``), initialises a gloo process group on
127.0.0.1 in each, calls ``fn(rank, n, arg)`` and returns the results in rank order. A rank
that raises makes the whole call raise with its traceback; a world that has not finished
within ``timeout`` seconds is killed and the call raises ``TimeoutError``, so a hang fails a
test instead of stalling CI. Each rank runs one OpenMP thread unless ``OMP_NUM_THREADS`` says
otherwise, so ranks sharing the machine's cores do not oversubscribe them.

Before the barrier and ``destroy_process_group`` each rank runs ``gc.collect()``: FSDP modules
(ours and FSDP1's alike) sit in reference cycles that keep the process group alive past
``destroy_process_group()``, and a gloo worker thread freeing finished work during interpreter
shutdown then aborts the process ("terminate called without an active exception").
"""

from __future__ import annotations

import contextlib
import gc
import os
import queue
import signal
import socket
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from multiprocessing import forkserver
from multiprocessing.context import ForkServerContext, SpawnContext
from multiprocessing.process import BaseProcess
from typing import TypeVar

import torch.distributed as dist
import torch.multiprocessing as mp

A = TypeVar("A")
R = TypeVar("R")


def free_port() -> int:
    """A TCP port free on the loopback interface right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _child(
    rank: int, world: int, port: int, fn: Callable[[int, int, A], R], arg: A, out: mp.Queue[object], backend: str
) -> None:
    try:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        result = fn(rank, world, arg)
        gc.collect()
        dist.barrier()
        out.put((rank, True, result))
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C (the parent's) must not cut the exit short
        out.put((rank, False, "KeyboardInterrupt"))
    except BaseException:  # noqa: BLE001  (every failure must reach the parent)
        out.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@contextlib.contextmanager
def _one_thread_per_rank() -> Iterator[None]:
    """While the ranks start: ``OMP_NUM_THREADS=1`` unless the user chose a value, so ranks
    sharing a machine's cores do not oversubscribe them. (It must be in the environment before
    torch is imported: in the fork server, which the first world starts; set inside a rank it
    has no effect.)"""
    chosen = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = chosen or "1"
    try:
        yield
    finally:
        if chosen is None:
            del os.environ["OMP_NUM_THREADS"]


PRELOAD = ("torch", "torch.distributed", "fsdp_shell.fsdp")
"""What the fork server imports once, before it forks any rank."""


def world_context() -> ForkServerContext | SpawnContext:
    """Where the platform has it, ``forkserver``: each rank is forked from one server process
    that has imported torch and this library (``PRELOAD``) once, instead of importing them
    itself (about 2 s of CPU per rank). The server starts at the first call, single-threaded,
    with this process's environment of that moment (one OpenMP thread per rank unless
    ``OMP_NUM_THREADS`` says otherwise), which every rank it forks inherits; it ends with this
    process. Elsewhere ``spawn``."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    with _one_thread_per_rank():
        forkserver.ensure_running()
    return ctx


def run_world(
    world: int, fn: Callable[[int, int, A], R], arg: A, timeout: float = 300.0, backend: str = "gloo"
) -> list[R]:
    """``fn(rank, world, arg)`` on each rank of a fresh world (gloo on loopback by default);
    results in rank order. ``fn``, ``arg`` and the results must pickle."""
    ctx = world_context()
    out: mp.Queue[object] = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_child, args=(r, world, port, fn, arg, out, backend), daemon=True) for r in range(world)
    ]
    with _one_thread_per_rank():
        for p in procs:
            p.start()
    results: dict[int, R] = {}
    try:
        while len(results) < world:
            try:
                item = out.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"gloo world of {world} did not finish within {timeout:.0f} s") from None
            assert isinstance(item, tuple) and len(item) == 3
            rank, ok, payload = item
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
            results[rank] = payload
    finally:
        _stop(procs, interrupt=len(results) < world)
    return [results[r] for r in range(world)]


def _stop(procs: Sequence[BaseProcess], *, interrupt: bool) -> None:
    """Wait for every rank to exit. When the world did not finish (a failure, a timeout, Ctrl-C
    in the parent alone) the ranks first get SIGINT, as a terminal's Ctrl-C would give them, so
    they end their own way (progress bars closed, process groups destroyed); a rank still alive
    after the wait (blocked in a collective) is killed."""
    if interrupt:
        deadline = time.monotonic() + 2.0  # ranks a terminal's Ctrl-C reached too end by themselves
        for p in procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive() and p.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGINT)
    for p in procs:
        p.join(timeout=5 if interrupt else 10)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
