"""``run_on_cluster``: a function on every rank of a gloo world on the emulated cluster
(``fsdp_shell.cluster.nodes``), results back in rank order, as ``fsdp_shell.cli.launch.run_world``
does on one machine.

Each rank is a process of its own in its node's namespace (``start_in``): ``python -c`` of this
module's ``_worker`` with the job's file, which holds the parent's ``multiprocessing`` spawn
preparation (its ``sys.path``, working directory and ``__main__``) and the pickled function and
argument. A rank writes its result, or its traceback, to a file of its own beside the job; the
parent polls those files and the ranks' exits, and stops every rank on the way out.
"""

from __future__ import annotations

import gc
import multiprocessing.spawn
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from typing import Any, TypeVar

from fsdp_shell.cluster.nodes import ADDRESSES, IMPORT_ROOT, NODES, PORT, Link, built, node_of, start_in

__all__ = ["run_on_cluster"]

A = TypeVar("A")
R = TypeVar("R")


def run_on_cluster(
    fn: Callable[[int, int, A], R], arg: A, *, rate_mbit: float = 400.0, ranks_per_node: int = 2, timeout: float = 600.0
) -> list[R]:
    """``fn(rank, world, arg)`` on each of ``2 * ranks_per_node`` ranks of a fresh emulated
    cluster (gloo, ``node_of`` placement, inter-node link shaped to ``rate_mbit``); results in
    rank order. Contract of ``fsdp_shell.cli.launch.run_world``: ``fn`` must be importable by
    module path (defined at top level of a module, or of the ``__main__`` script, which each
    rank imports as ``__mp_main__`` as multiprocessing's spawn does), ``fn``, ``arg`` and the
    results must pickle; a rank that raises makes this raise ``RuntimeError`` with its
    traceback, and a world not done within ``timeout`` seconds (counted from the ranks' start)
    raises ``TimeoutError``; either way every rank is killed. Raises ``RuntimeError`` with the
    reason when the cluster cannot be built (see ``cluster_available``). The namespaces are
    gone when this returns or raises."""
    if ranks_per_node < 1:
        raise ValueError(f"ranks_per_node must be at least 1, got {ranks_per_node}")
    world = NODES * ranks_per_node
    prep = multiprocessing.spawn.get_preparation_data("rank")
    prep.pop("authkey", None)
    job_blob = pickle.dumps((prep, pickle.dumps((fn, arg)), world))
    code = "from fsdp_shell.cluster.run import _worker; _worker()"
    with built(Link.at(rate_mbit)) as (names, hold), tempfile.TemporaryDirectory(prefix="fsdp-cluster-") as tmp:
        job = Path(tmp) / "job.pkl"
        job.write_bytes(job_blob)
        procs: list[subprocess.Popen[str]] = []
        try:
            for rank in range(world):
                ns = names[node_of(rank, ranks_per_node)]
                procs.append(start_in(ns, [sys.executable, "-c", code, str(job), str(rank)]))
            results: list[R] = _collect(procs, job, timeout)
            _stop(procs, grace=10.0)
            return results
        finally:
            hold()
            _stop(procs, grace=0.0)


def _stop(procs: list[subprocess.Popen[str]], grace: float) -> None:
    """Wait up to ``grace`` s for the ranks to exit, then kill each rank's process group."""
    deadline = time.monotonic() + grace
    for p in procs:
        with suppress(subprocess.TimeoutExpired):
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.poll() is None:
            with suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def _collect(procs: list[subprocess.Popen[str]], job: Path, timeout: float) -> list[Any]:
    """Results in rank order, polling the ranks' result files. Raises on a failure, naming the
    rank whose failure was written first (peers of a failed rank fail after it)."""
    world = len(procs)
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    while len(results) < world:
        failed: list[tuple[int, int, str]] = []
        for rank, p in enumerate(procs):
            if rank in results:
                continue
            exited = p.poll()  # before looking for the file: a rank writes it, then exits
            path = job.parent / f"result-{rank}.pkl"
            if path.exists():
                ok, payload = pickle.loads(path.read_bytes())
                if ok:
                    results[rank] = payload
                else:
                    failed.append((path.stat().st_mtime_ns, rank, f"rank {rank} failed:\n{payload}"))
            elif exited is not None:
                failed.append(
                    (
                        time.time_ns(),
                        rank,
                        f"rank {rank} exited with code {exited} before returning a result (its stderr is above)",
                    )
                )
        if failed:
            raise RuntimeError(min(failed)[2])
        if len(results) < world:
            if time.monotonic() > deadline:
                raise TimeoutError(f"cluster world of {world} did not finish within {timeout:.0f} s")
            time.sleep(0.02)
    return [results[r] for r in range(world)]


def _worker() -> None:
    """A rank's process: ``python -c ... <job.pkl> <rank>`` inside its node's namespace."""
    job, rank = Path(sys.argv[1]), int(sys.argv[2])
    prep, payload, world = pickle.loads(job.read_bytes())
    import torch.distributed as dist

    result: tuple[bool, object]
    try:
        multiprocessing.spawn.prepare(prep)  # the parent's sys.path, cwd and __main__
        if str(IMPORT_ROOT) not in sys.path:
            sys.path.append(str(IMPORT_ROOT))
        fn, arg = pickle.loads(payload)
        dist.init_process_group("gloo", init_method=f"tcp://{ADDRESSES[0]}:{PORT}", rank=rank, world_size=world)
        value = fn(rank, world, arg)
        gc.collect()
        dist.barrier()
        result = (True, value)
    except BaseException:  # noqa: BLE001  (every failure must reach the parent)
        result = (False, traceback.format_exc())
    try:
        blob = pickle.dumps(result)
    except Exception:  # noqa: BLE001
        blob = pickle.dumps((False, traceback.format_exc()))
    tmp = job.parent / f"result-{rank}.tmp"
    tmp.write_bytes(blob)
    tmp.replace(job.parent / f"result-{rank}.pkl")
    if dist.is_initialized():
        dist.destroy_process_group()
