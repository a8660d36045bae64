"""An emulated two-node cluster on one machine: gloo ranks in two network namespaces whose
only link is a rate-limited veth pair.

Usage, from a benchmark script (run from the repository root, ``PYTHONPATH=.``)::

    from benchmarks.cluster import cluster_available, node_of, run_on_cluster

    def step(rank: int, world: int, arg: int) -> float:   # top level, so it pickles
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        ...                                                 # shard groups are intra-node

    if (reason := cluster_available()) is not None:
        sys.exit(f"no emulated cluster: {reason}")
    times = run_on_cluster(step, 10, rate_mbit=400.0, ranks_per_node=2)

Self-check, printing the measured link figures: ``python benchmarks/cluster.py [--rate 400]``.

Topology. Namespaces ``fsdpnode0-<pid>-<n>`` and ``fsdpnode1-<pid>-<n>`` (``pid`` in hex,
``n`` counting runs in this process), each with ``lo`` up and one end of a veth pair named
``eth0``, addressed 10.213.7.1/24 and 10.213.7.2/24. Ranks ``0 .. ranks_per_node - 1`` run in
node 0, the rest in node 1 (``node_of``), so ``init_device_mesh("cpu", (2, ranks_per_node))``
gives (replicate, shard) groups whose shard groups never leave a node. Every rank sets
``GLOO_SOCKET_IFNAME=eth0``: gloo binds its node's veth address, two ranks of one node talk
through their namespace's local stack (memory speed) and ranks of different nodes through the
veth, limited in each direction by ``tc ... tbf`` on the sending end (see ``Link``). There is
no propagation delay (netem is not used): the link adds serialisation time and queueing only.

The pair is created directly inside the namespaces, so nothing is added to the root namespace
and deleting the two namespaces removes the veth ends and their qdiscs with them. Each
namespace also gets ``/etc/netns/<namespace>/nsswitch.conf`` (``ip netns exec`` mounts it over
``/etc/nsswitch.conf``) resolving host names from ``/etc/hosts`` only: a node has no route to
this machine's DNS server, and c10d's failing look-ups would otherwise print "The hostname of
the client socket cannot be retrieved" once per rank. It is deleted with the namespace (the
directory ``/etc/netns``, iproute2's, is created if absent and left).

Lifetime. The namespaces exist only during ``run_on_cluster``; they are deleted on every exit
path the process survives: return, a failing rank, a timeout, ``KeyboardInterrupt`` and
SIGTERM/SIGHUP (the signal is re-delivered once the namespaces are gone). A parent killed by
SIGKILL cannot clean up: its ranks die with it (``PR_SET_PDEATHSIG``) and its namespaces are
swept by the next run, which deletes ``fsdpnode*`` namespaces whose pid no longer exists.
"""

from __future__ import annotations

import ctypes
import gc
import itertools
import multiprocessing.spawn
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, TypeVar

A = TypeVar("A")
R = TypeVar("R")

NODES = 2
"""Nodes in the emulated cluster."""

ADDRESSES = ("10.213.7.1", "10.213.7.2")
"""IPv4 address of node 0's and node 1's veth end (prefix /24)."""

IFNAME = "eth0"
"""Name of the veth end inside each node's namespace (the name is per namespace)."""

PORT = 29500
"""TCP store port on node 0; always free, the namespace being new."""

_REPO = Path(__file__).resolve().parent.parent
_NAME = re.compile(r"^fsdpnode[01]-([0-9a-f]+)-[0-9]+$")
_RUNS = itertools.count()
_ETC_NETNS = Path("/etc/netns")


@dataclass(frozen=True, slots=True, kw_only=True)
class Link:
    """The tbf shaping of each direction of the inter-node link.

    tbf sends at line speed while its bucket holds tokens and at ``rate_mbit`` once it is
    empty; the bucket refills at the rate up to ``burst_bytes``. So after an idle moment the
    first ``burst_bytes`` of a transfer pass unshaped: a message of ``m`` bytes takes about
    ``(m - burst) / rate``, within 2 % of ``m / rate`` from ~3 MiB at the default burst.
    """

    rate_mbit: float
    """Shaped rate, megabits (10^6 bits) per second, Ethernet/IP/TCP headers included: TCP
    payload gets about 96 % of it at MTU 1500."""
    burst_bytes: int
    """Bucket size: 1 ms at the rate, but at least 64 KiB, the largest GSO packet the veth
    hands the qdisc (a smaller bucket makes tbf split every such packet)."""
    latency_ms: float
    """Longest a packet may wait in the queue (tbf drops beyond): the queue holds
    ``rate * latency + burst`` bytes, 20 ms being a switch-sized buffer, which TCP's small-queue
    limit keeps a few flows from filling."""

    @staticmethod
    def at(rate_mbit: float) -> Link:
        """The shaping used for ``rate_mbit``."""
        if not rate_mbit > 0:
            raise ValueError(f"rate_mbit must be positive, got {rate_mbit}")
        return Link(rate_mbit=rate_mbit, burst_bytes=max(64 * 1024, round(rate_mbit * 1e6 / 8 / 1000)), latency_ms=20.0)

    def tc_args(self) -> list[str]:
        """The ``tbf`` parameters for ``tc qdisc add dev ... root``."""
        return [
            "tbf",
            "rate",
            f"{self.rate_mbit:g}mbit",
            "burst",
            str(self.burst_bytes),
            "latency",
            f"{self.latency_ms:g}ms",
        ]


def node_of(rank: int, ranks_per_node: int = 2) -> int:
    """The node (0 or 1) that ``run_on_cluster`` places ``rank`` on."""
    return rank // ranks_per_node


class _SetupFailed(RuntimeError):
    """A command building the cluster failed; the message is the reason."""


def _cmd(label: str, *argv: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise _SetupFailed(f"{label} failed: {(done.stderr or done.stdout).strip() or f'exit {done.returncode}'}")


def _namespaces() -> list[str]:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    return [line.split()[0] for line in listed.splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _sweep_stale() -> None:
    """Delete the namespaces of earlier runs whose process is gone (it was SIGKILLed)."""
    for ns in _namespaces():
        if (m := _NAME.match(ns)) is not None and not _pid_alive(int(m.group(1), 16)):
            _destroy([ns])


def _nsswitch_files_only() -> str:
    """This machine's ``/etc/nsswitch.conf`` with host names resolved from ``/etc/hosts`` only."""
    try:
        lines = Path("/etc/nsswitch.conf").read_text().splitlines()
    except OSError:
        lines = []
    return "".join(f"{line}\n" for line in lines if not line.startswith("hosts:")) + "hosts: files\n"


def _create(names: tuple[str, str], link: Link) -> None:
    """Build both nodes; raises ``_SetupFailed``. The caller deletes ``names`` afterwards,
    whatever this did."""
    for ns in names:
        _cmd("ip netns add", "ip", "netns", "add", ns)
        try:
            (_ETC_NETNS / ns).mkdir(parents=True, exist_ok=True)
            (_ETC_NETNS / ns / "nsswitch.conf").write_text(_nsswitch_files_only())
        except OSError as e:
            raise _SetupFailed(f"writing {_ETC_NETNS / ns}/nsswitch.conf failed: {e}") from None
    _cmd(
        "ip link add (veth)",
        "ip",
        "link",
        "add",
        IFNAME,
        "netns",
        names[0],
        "type",
        "veth",
        "peer",
        "name",
        IFNAME,
        "netns",
        names[1],
    )
    for ns, address in zip(names, ADDRESSES):
        _cmd("ip link set lo up", "ip", "-n", ns, "link", "set", "lo", "up")
        _cmd("ip addr add", "ip", "-n", ns, "addr", "add", f"{address}/24", "dev", IFNAME)
        _cmd("ip link set up", "ip", "-n", ns, "link", "set", IFNAME, "up")
        _cmd("tc qdisc add", "tc", "-n", ns, "qdisc", "add", "dev", IFNAME, "root", *link.tc_args())


def _destroy(names: Iterable[str]) -> None:
    """Delete whichever of ``names`` exist (with them the veth ends and their qdiscs) and
    their ``/etc/netns`` directories (``/etc/netns`` itself stays: a concurrent run may be
    creating its own directory in it)."""
    for ns in names:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
        shutil.rmtree(_ETC_NETNS / ns, ignore_errors=True)


def _names() -> tuple[str, str]:
    suffix = f"{os.getpid():x}-{next(_RUNS)}"
    return (f"fsdpnode0-{suffix}", f"fsdpnode1-{suffix}")


def _unavailable() -> str | None:
    if os.geteuid() != 0:
        return "needs root (uid 0) to create network namespaces"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) not found on PATH"
    return None


def cluster_available() -> str | None:
    """None when this machine can build the cluster, else the reason it cannot. Builds and
    deletes a probe cluster (namespaces, veth, tbf), about 0.1 s."""
    if (reason := _unavailable()) is not None:
        return reason
    names = _names()
    try:
        _create(names, Link.at(400.0))
    except _SetupFailed as e:
        return str(e)
    finally:
        _destroy(names)
    return None


class _Signalled(BaseException):
    """Raised by ``_signals_unwind``'s handler to unwind ``run_on_cluster``."""


@contextmanager
def _signals_unwind() -> Iterator[Callable[[], None]]:
    """SIGINT, SIGTERM and SIGHUP raise ``_Signalled`` inside the block, so ``finally``
    clauses run; the yielded ``hold()`` makes later ones wait (during cleanup). On exit the
    previous handlers are restored and a signal received is delivered to them. Only in the main
    thread (elsewhere Python cannot set handlers and this does nothing)."""
    if threading.current_thread() is not threading.main_thread():
        yield lambda: None
        return
    received: list[int] = []
    holding = False

    def handler(signum: int, frame: FrameType | None) -> None:
        nonlocal holding
        received.append(signum)
        if not holding:  # raise once: a second signal must not interrupt the cleanup
            holding = True
            raise _Signalled(signal.Signals(signum).name)

    def hold() -> None:
        nonlocal holding
        holding = True

    wanted = [s for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP) if signal.getsignal(s) is not signal.SIG_IGN]
    previous = {s: signal.signal(s, handler) for s in wanted}
    try:
        yield hold
    except _Signalled:
        pass  # re-delivered below
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        if received:
            signal.raise_signal(received[0])
            raise InterruptedError(f"run_on_cluster interrupted by {signal.Signals(received[0]).name}")


_libc = ctypes.CDLL(None, use_errno=True)


def _die_with_parent() -> None:
    """In the rank's process before exec: SIGKILL it when the parent dies."""
    PR_SET_PDEATHSIG = 1
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


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
    code = "from benchmarks.cluster import _worker; _worker()"
    with _cluster(Link.at(rate_mbit)) as (names, hold), tempfile.TemporaryDirectory(prefix="fsdp-cluster-") as tmp:
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


@contextmanager
def nodes(*, rate_mbit: float = 400.0) -> Iterator[tuple[str, str]]:
    """The two nodes' namespaces, to run commands in (``start_in``), for a launcher of one's own
    such as ``torchrun`` in each node: created on entry, deleted on every exit path as
    ``run_on_cluster`` deletes its own. Raises ``RuntimeError`` with the reason when the cluster
    cannot be built."""
    with _cluster(Link.at(rate_mbit)) as (names, _):
        yield names


@contextmanager
def _cluster(link: Link) -> Iterator[tuple[tuple[str, str], Callable[[], None]]]:
    """Both nodes (their namespaces' names) and ``_signals_unwind``'s ``hold``, for the block;
    the namespaces are deleted on every exit path (module docstring, "Lifetime")."""
    if (reason := _unavailable()) is not None:
        raise RuntimeError(f"emulated cluster unavailable: {reason}")
    names = _names()
    with _signals_unwind() as hold:
        try:
            _sweep_stale()
            try:
                _create(names, link)
            except _SetupFailed as e:
                raise RuntimeError(f"emulated cluster unavailable: {e}") from None
            yield names, hold
        finally:
            hold()
            _destroy(names)


def start_in(ns: str, argv: list[str], **popen: Any) -> subprocess.Popen[str]:
    """``argv`` as a process in namespace ``ns``, as a rank of ``run_on_cluster`` runs: gloo on
    the node's veth (``GLOO_SOCKET_IFNAME``), this repository importable, a session of its own,
    killed when this process dies; ``popen``: further ``subprocess.Popen`` arguments (text
    mode)."""
    env = dict(popen.pop("env", os.environ), GLOO_SOCKET_IFNAME=IFNAME)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = os.pathsep.join([str(_REPO), *filter(None, [env.get("PYTHONPATH")])])
    return subprocess.Popen(
        ["ip", "netns", "exec", ns, *argv],
        env=env,
        text=True,
        start_new_session=True,
        preexec_fn=_die_with_parent,  # noqa: PLW1509  (only prctl, before any thread of the child starts)
        **popen,
    )


def _worker() -> None:
    """A rank's process: ``python -c ... <job.pkl> <rank>`` inside its node's namespace."""
    job, rank = Path(sys.argv[1]), int(sys.argv[2])
    prep, payload, world = pickle.loads(job.read_bytes())
    import torch.distributed as dist

    result: tuple[bool, object]
    try:
        multiprocessing.spawn.prepare(prep)  # the parent's sys.path, cwd and __main__
        if str(_REPO) not in sys.path:
            sys.path.append(str(_REPO))
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


# --- self-check -------------------------------------------------------------------------------

_MB = 1_000_000


def _probe(rank: int, world: int, nbytes: int) -> dict[tuple[str, int], float]:
    """Median seconds, measured on rank 0: ``("send", peer)`` for ``nbytes`` sent to ``peer``
    and one element sent back (rank 1 is on node 0, rank ``world // 2`` on node 1),
    ``("send 1MB", world // 2)`` likewise for 1 MB, ``("ping", peer)`` for one element there
    and back, ``("all_reduce", world)`` for a one-element all-reduce of all ranks."""
    import statistics

    import torch
    import torch.distributed as dist

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
    import argparse

    parser = argparse.ArgumentParser(description="Measure the emulated two-node cluster's links.")
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
