"""The emulated cluster's two nodes: network namespaces on this machine whose only link is a
rate-limited veth pair; each is built for a block and deleted on every way out of it.

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

Lifetime. The namespaces exist only during ``built`` (``run_on_cluster``'s run, ``nodes``'
block); they are deleted on every exit path the process survives: return, a failing rank, a
timeout, ``KeyboardInterrupt`` and SIGTERM/SIGHUP (the signal is re-delivered once the
namespaces are gone). A parent killed by SIGKILL cannot clean up: its ranks die with it
(``PR_SET_PDEATHSIG``, ``start_in``) and its namespaces are swept by the next run, which
deletes ``fsdpnode*`` namespaces whose pid no longer exists.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import re
import shutil
import signal
import subprocess
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

__all__ = [
    "ADDRESSES",
    "IFNAME",
    "IMPORT_ROOT",
    "NODES",
    "PORT",
    "Link",
    "built",
    "cluster_available",
    "node_of",
    "nodes",
    "start_in",
]

NODES = 2
"""Nodes in the emulated cluster."""

ADDRESSES = ("10.213.7.1", "10.213.7.2")
"""IPv4 address of node 0's and node 1's veth end (prefix /24)."""

IFNAME = "eth0"
"""Name of the veth end inside each node's namespace (the name is per namespace)."""

PORT = 29500
"""TCP store port on node 0; always free, the namespace being new."""

IMPORT_ROOT = Path(__file__).resolve().parents[2]
"""The directory that holds ``fsdp_shell`` (the repository, in an editable install): on the
path of every process started in a node, so modules beside the library (a benchmark's, a
test's) import there as they do here."""

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


@contextmanager
def nodes(*, rate_mbit: float = 400.0) -> Iterator[tuple[str, str]]:
    """The two nodes' namespaces, to run commands in (``start_in``), for a launcher of one's own
    such as ``torchrun`` in each node: created on entry, deleted on every exit path as
    ``run_on_cluster`` deletes its own. Raises ``RuntimeError`` with the reason when the cluster
    cannot be built."""
    with built(Link.at(rate_mbit)) as (names, _):
        yield names


@contextmanager
def built(link: Link) -> Iterator[tuple[tuple[str, str], Callable[[], None]]]:
    """Both nodes (their namespaces' names), their link shaped as ``link``, and a ``hold()``
    that makes a signal received from then on wait until the block has cleaned up (call it
    before stopping what runs in the nodes); the namespaces are deleted on every exit path
    (module docstring, "Lifetime"). Raises ``RuntimeError`` with the reason when the cluster
    cannot be built."""
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
    the node's veth (``GLOO_SOCKET_IFNAME``), ``IMPORT_ROOT`` importable, a session of its own,
    killed when this process dies; ``popen``: further ``subprocess.Popen`` arguments (text
    mode)."""
    env = dict(popen.pop("env", os.environ), GLOO_SOCKET_IFNAME=IFNAME)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = os.pathsep.join([str(IMPORT_ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return subprocess.Popen(
        ["ip", "netns", "exec", ns, *argv],
        env=env,
        text=True,
        start_new_session=True,
        preexec_fn=_die_with_parent,  # noqa: PLW1509  (only prctl, before any thread of the child starts)
        **popen,
    )
