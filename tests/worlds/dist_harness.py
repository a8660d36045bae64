"""Real gloo worlds on loopback for the tests, reused across cases.

``run_world(n, fn, arg)`` runs ``fn(rank, n, arg)`` on every rank of a world of ``n`` processes
and returns the results in rank order, like ``fsdp_shell.cli.launch.run_world`` (which starts a
fresh world each time: about 1.5 s for 2 ranks and 3 s for 4 before any test work, more under
coverage). Here a world of each size is started once and kept (PyTorch's
``MultiProcContinuousTest`` does the same for a test class): each rank waits for the next case,
runs it, collects garbage and meets the others at a barrier. A world is replaced after
``CASES_PER_WORLD`` cases (every FSDP tree makes a gloo group of its own, with its threads and
connections), and whenever a case fails or times out, since its ranks may be left mid-collective.
After each case the CPU runtime factory is reset (``set_cpu_runtime(None)``), the one
process-wide setting a case may leave behind.

``fresh=True`` starts a world of its own, for cases that are about the world: ranks that hang
or time out on purpose, groups with short timeouts, mismatched configurations. Set
``FSDP_TEST_FRESH_WORLDS=1`` to run every case in a fresh world. ``close_worlds()`` ends the kept
worlds cleanly (``tests/conftest.py`` calls it when the session ends), so coverage.py saves what
their ranks ran.
"""

from __future__ import annotations

import gc
import os
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist
import torch.multiprocessing as mp

from fsdp_shell.cli import launch
from fsdp_shell.cli.launch import free_port

__all__ = ["CASES_PER_WORLD", "close_worlds", "free_port", "run_world"]

A = TypeVar("A")
R = TypeVar("R")

CASES_PER_WORLD = 25
"""Cases a kept world runs before it is replaced."""

EXIT_SECONDS = 120.0
"""How long the kept worlds get to exit at the end: a rank that ran many cases under coverage.py
takes a while to write its data, and a rank killed while writing loses it."""


def _serve(rank: int, world: int, port: int, inbox: mp.Queue[Any], out: mp.Queue[Any]) -> None:
    from fsdp_shell.runtime.device import set_cpu_runtime

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        while (job := inbox.get()) is not None:
            fn, arg = job
            try:
                result = fn(rank, world, arg)
                del fn, arg, job
                gc.collect()
                dist.barrier()
                out.put((rank, True, result))
            except BaseException:  # noqa: BLE001  (every failure must reach the parent)
                out.put((rank, False, traceback.format_exc()))
            finally:
                set_cpu_runtime(None)
    finally:
        gc.collect()
        dist.destroy_process_group()


class _World:
    def __init__(self, size: int) -> None:
        ctx = mp.get_context("spawn")  # kept worlds start seldom; the memory cases run in them as they always have
        self.size = size
        self.cases = 0
        self.out: mp.Queue[Any] = ctx.Queue()
        self.inboxes: list[mp.Queue[Any]] = [ctx.Queue() for _ in range(size)]
        port = free_port()
        with launch._one_thread_per_rank():
            self.procs = [
                ctx.Process(target=_serve, args=(r, size, port, self.inboxes[r], self.out), daemon=True)
                for r in range(size)
            ]
            for p in self.procs:
                p.start()

    def run(self, fn: Callable[[int, int, A], R], arg: A, timeout: float) -> list[R]:
        self.cases += 1
        for inbox in self.inboxes:
            inbox.put((fn, arg))
        results: dict[int, R] = {}
        while len(results) < self.size:
            try:
                rank, ok, payload = self.out.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"gloo world of {self.size} did not finish within {timeout:.0f} s") from None
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
            results[rank] = payload
        return [results[r] for r in range(self.size)]

    def close(self, *, kill: bool) -> None:
        self.ask_to_end()
        if not kill:
            self.wait_to_end(time.monotonic() + EXIT_SECONDS)
        launch._stop(self.procs, interrupt=kill)

    def wait_to_end(self, deadline: float) -> None:
        for p in self.procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))

    def ask_to_end(self) -> None:
        for inbox in self.inboxes:
            inbox.put(None)


_worlds: dict[int, _World] = {}


def run_world(
    world: int,
    fn: Callable[[int, int, A], R],
    arg: A,
    timeout: float = 300.0,
    backend: str = "gloo",
    *,
    fresh: bool = False,
) -> list[R]:
    """``fn(rank, world, arg)`` on every rank of a kept gloo world of ``world`` ranks (module
    docstring); a fresh one with ``fresh``, another backend or ``FSDP_TEST_FRESH_WORLDS=1``."""
    if fresh or backend != "gloo" or os.environ.get("FSDP_TEST_FRESH_WORLDS") == "1":
        return launch.run_world(world, fn, arg, timeout, backend)
    kept = _worlds.get(world)
    if kept is None or kept.cases >= CASES_PER_WORLD or not all(p.is_alive() for p in kept.procs):
        if kept is not None:
            kept.close(kill=not all(p.is_alive() for p in kept.procs))
        kept = _worlds[world] = _World(world)
    try:
        return kept.run(fn, arg, timeout)
    except BaseException:
        del _worlds[world]
        kept.close(kill=True)
        raise


def close_worlds() -> None:
    """End every kept world: each rank leaves its loop, destroys its process group and exits
    (all worlds asked at once, then waited for)."""
    kept = list(_worlds.values())
    _worlds.clear()
    for world in kept:
        world.ask_to_end()
    deadline = time.monotonic() + EXIT_SECONDS
    for world in kept:
        world.wait_to_end(deadline)
        launch._stop(world.procs, interrupt=False)
