"""The emulated two-node cluster (``fsdp_shell.cluster``): rank placement, failure and
timeout reporting, and that no namespace outlives a run on any exit path. No timing checks.
Skipped, with the reason, where network namespaces cannot be created (not root, a container
without CAP_SYS_ADMIN/CAP_NET_ADMIN, no iproute2)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fsdp_shell.cluster import ADDRESSES, IFNAME, cluster_available, node_of, run_on_cluster
from tests.worlds.cluster_cases import raise_on_rank_1, sleep, whoami

REPO = Path(__file__).resolve().parents[2]
_REASON = cluster_available()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=f"emulated cluster unavailable: {_REASON}")


def _namespaces_of(pid: int) -> list[str]:
    """The namespaces ``run_on_cluster`` in process ``pid`` has now."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return [
        w
        for line in listed.splitlines()
        for w in line.split()[:1]
        if w.startswith("fsdpnode") and w.split("-")[1] == f"{pid:x}"
    ]


@pytest.fixture(scope="module")
def placed() -> list[tuple[int, int, str, str, float]]:
    return run_on_cluster(whoami, None, ranks_per_node=2, timeout=120.0)


def test_ranks_0_1_on_node0_and_2_3_on_node1(placed: list[tuple[int, int, str, str, float]]) -> None:
    assert [r[:2] for r in placed] == [(0, 4), (1, 4), (2, 4), (3, 4)]
    assert [node_of(r) for r in range(4)] == [0, 0, 1, 1]
    assert [r[3] for r in placed] == [ADDRESSES[0], ADDRESSES[0], ADDRESSES[1], ADDRESSES[1]]
    namespaces = [r[2] for r in placed]
    assert namespaces[0] == namespaces[1] != namespaces[2] == namespaces[3]
    assert namespaces[0].startswith("fsdpnode0-") and namespaces[2].startswith("fsdpnode1-")
    assert [r[4] for r in placed] == [6.0] * 4  # 0 + 1 + 2 + 3 across the link
    assert IFNAME == "eth0"


def test_no_namespace_left_after_a_run(placed: list[tuple[int, int, str, str, float]]) -> None:
    assert _namespaces_of(os.getpid()) == []


def test_failing_rank_raises_with_its_traceback_and_cleans_up() -> None:
    with pytest.raises(RuntimeError, match="rank 1 failed") as info:
        run_on_cluster(raise_on_rank_1, "boom from rank 1", ranks_per_node=1, timeout=120.0)
    assert "ValueError: boom from rank 1" in str(info.value)
    assert "raise_on_rank_1" in str(info.value)
    assert _namespaces_of(os.getpid()) == []


def test_timeout_kills_ranks_and_cleans_up() -> None:
    with pytest.raises(TimeoutError, match="did not finish within"):
        run_on_cluster(sleep, 60.0, ranks_per_node=1, timeout=0.5)
    assert _namespaces_of(os.getpid()) == []


def test_next_run_sweeps_namespaces_of_a_dead_process() -> None:
    dead = 0xFFFFFFF  # above any pid_max
    subprocess.run(["ip", "netns", "add", f"fsdpnode0-{dead:x}-0"], check=True)
    try:
        with pytest.raises(TimeoutError):
            run_on_cluster(sleep, 60.0, ranks_per_node=1, timeout=0.1)
        assert _namespaces_of(dead) == []
    finally:
        subprocess.run(["ip", "netns", "del", f"fsdpnode0-{dead:x}-0"], capture_output=True, check=False)


@pytest.mark.usefixtures("sigint_reaches_children")
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signalled_parent_kills_ranks_and_cleans_up(signum: signal.Signals) -> None:
    code = (
        "from fsdp_shell.cluster import run_on_cluster; from tests.worlds.cluster_cases import sleep; "
        "run_on_cluster(sleep, 60.0, ranks_per_node=1, timeout=120.0)"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]))
    parent = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)
    try:
        ranks: list[int] = []
        deadline = time.monotonic() + 30.0
        while len(ranks) < 2 and time.monotonic() < deadline:  # both ranks started in their nodes
            ranks = [
                int(pid)
                for ns in _namespaces_of(parent.pid)
                for pid in subprocess.run(
                    ["ip", "netns", "pids", ns], capture_output=True, text=True, check=False
                ).stdout.split()
            ]
            time.sleep(0.05)
        assert len(ranks) == 2, "the ranks did not start"
        parent.send_signal(signum)
        _, stderr = parent.communicate(timeout=30.0)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.communicate()
    assert parent.returncode == -signum, stderr  # re-delivered to the default disposition
    assert _namespaces_of(parent.pid) == []
    for pid in ranks:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
