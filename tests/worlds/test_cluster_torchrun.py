"""Multi-node as users launch it, on the emulated two-node cluster (``fsdp_shell.cluster``).

``torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint <node 0>:PORT``
started in each node's namespace runs ``fsdp-demo --strategy HYBRID_SHARD --check --save``: the
shard groups are the two ranks of a node (``LOCAL_WORLD_SIZE``), the check against the
single-process reference passes, the checkpoint is written by both nodes; then ``torchrun`` on
node 0 alone (2 ranks) resumes it and trains on. Not a timed test. Skipped, with the reason,
where the namespaces cannot be made (not root, no iproute2).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_shell.cluster import ADDRESSES, PORT, cluster_available, nodes, start_in

REPO = Path(__file__).resolve().parents[2]
_REASON = cluster_available()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=f"emulated cluster unavailable: {_REASON}")

TIMEOUT = 240
QUICK = ["--quiet", "--layers", "2", "--width", "32", "--batch-size", "4", "--eval-every", "100"]


def _torchrun(ns: str, node: int, nnodes: int, run: str, args: list[str]) -> subprocess.Popen[str]:
    """torchrun in namespace ``ns`` of node ``node``. Node 0 serves the rendezvous store
    (``is_host``: c10d cannot tell from the endpoint, which is not the machine's host name), and
    each node gives its veth address (``--local-addr``), which the ranks then reach it by."""
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(nnodes),
        "--nproc-per-node",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"{ADDRESSES[0]}:{PORT}",
        "--rdzv-id",
        run,
        "--rdzv-conf",
        f"is_host={str(node == 0).lower()}",
        "--local-addr",
        ADDRESSES[node],
        "-m",
        "fsdp_shell.demo.cli",
        "--strategy",
        "HYBRID_SHARD",
        *QUICK,
        *args,
    ]
    return start_in(ns, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO)


def _finish(procs: list[subprocess.Popen[str]]) -> list[str]:
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        assert p.returncode == 0, err[-3000:]
        outs.append(out)
    return outs


def _value(out: str, key: str) -> str:
    lines = [line.split(key, 1)[1].strip() for line in out.splitlines() if line.lstrip().startswith(key)]
    assert len(lines) == 1, out
    return lines[0]


def test_torchrun_on_two_nodes_trains_hybrid_checks_saves_and_resumes_on_one(tmp_path: Path) -> None:
    checkpoint = tmp_path / "checkpoint"
    with nodes() as (node0, node1):
        args = ["--steps", "4", "--check", "--save", str(checkpoint)]
        both = [_torchrun(ns, node, 2, "two-nodes", args) for node, ns in enumerate((node0, node1))]
        first, second = _finish(both)
        assert _value(first, "strategy") == "HYBRID_SHARD on 4 rank(s), shard groups of 2"
        assert "OK" in _value(first, "check")
        assert _value(first, "saved").startswith(f"{checkpoint} at step 4")
        assert "strategy" not in second  # rank 0, on node 0, reports
        resume = ["--steps", "6", "--resume", str(checkpoint)]
        (alone,) = _finish([_torchrun(node0, 0, 1, "one-node", resume)])
    assert _value(alone, "strategy") == "HYBRID_SHARD on 2 rank(s), shard groups of 2"
    assert _value(alone, "resumed from").startswith(f"{checkpoint} at step 4")
    assert _value(alone, "steps") == "5..6"
