"""The gradient path, traced: every library function that runs, on any thread, during the
steady-state ``loss.backward()`` of a one-unit model (``Linear(10, 9)``, FULL_SHARD, 2 gloo
ranks), for this library's FSDP1 API, PyTorch's FSDP2 (``fully_shard``) and this library's
``fully_shard`` on the same model.

Run on demand: ``python scripts/gradient_path.py [--json] [--list]``. Prints, per
implementation, the distinct functions and files that ran and how often the call sequence moved
from one file to another. Library code is ``fsdp_core``/``fsdp_shell`` for ours and
``torch/distributed/fsdp`` for FSDP2. ``docs/design.md`` quotes the counts and
``tests/meta/test_docs_build.py`` checks them against this script's ``--json``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fsdp_shell.cli.launch import run_world

ROOT = Path(__file__).resolve().parent.parent
TORCH_FSDP = str(Path(torch.__file__).resolve().parent / "distributed" / "fsdp")
OURS = (str(ROOT / "fsdp_core"), str(ROOT / "fsdp_shell"))


_COMPREHENSIONS = frozenset({"<genexpr>", "<listcomp>", "<dictcomp>", "<setcomp>"})
"""Not counted: Python 3.12 inlines comprehensions into their function (PEP 709)."""


class _Tracer:
    """A profile function for every Python thread (the lane thread, started lazily, included:
    ``threading.setprofile`` is set before the model is built), recording only while ``on``."""

    def __init__(self) -> None:
        self.on = False
        self.library: tuple[str, ...] = ()
        self.calls: list[tuple[str, str]] = []
        self._lock = threading.Lock()
        threading.setprofile(self)

    def __call__(self, frame: FrameType, event: str, arg: object) -> None:
        if not self.on or event != "call":
            return
        path = frame.f_code.co_filename
        if path.startswith(self.library) and frame.f_code.co_name not in _COMPREHENSIONS:
            with self._lock:
                self.calls.append((path, frame.f_code.co_qualname))


def _trace(tracer: _Tracer, model: nn.Module, x: torch.Tensor, library: tuple[str, ...]) -> dict[str, Any]:
    tracer.library, tracer.calls = library, []
    for _ in range(3):  # the first iterations record orders and build plans
        model(x).sum().backward()
        model.zero_grad()
    loss = model(x).sum()
    dist.barrier()
    tracer.on = True
    sys.setprofile(tracer)
    try:
        loss.backward()
    finally:
        sys.setprofile(None)
        tracer.on = False
    calls = tracer.calls
    functions = sorted({f"{Path(p).relative_to(_base(p)).as_posix()}:{q}" for p, q in calls})
    files = sorted({Path(p).relative_to(_base(p)).as_posix() for p, _ in calls})
    changes = sum(1 for a, b in itertools.pairwise(calls) if a[0] != b[0])
    return {"functions": len(functions), "files": len(files), "file_changes": changes, "listed": functions}


def _base(path: str) -> Path:
    return Path(TORCH_FSDP).parent.parent.parent if path.startswith(TORCH_FSDP) else ROOT


def trace_rank(rank: int, world: int, arg: None) -> dict[str, dict[str, Any]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from fsdp_shell import FSDP
    from fsdp_shell import fully_shard as ours_fully_shard

    tracer = _Tracer()
    torch.manual_seed(0)
    x = torch.randn(4, 10)
    ours = _trace(tracer, FSDP(nn.Linear(10, 9)), x, OURS)
    mesh = init_device_mesh("cpu", (world,))
    sharded = nn.Linear(10, 9)
    fully_shard(sharded, mesh=mesh)
    fsdp2 = _trace(tracer, sharded, x, (TORCH_FSDP,))
    mine = nn.Linear(10, 9)
    ours_fully_shard(mine, mesh=mesh)
    return {"ours": ours, "fsdp2": fsdp2, "ours_fully_shard": _trace(tracer, mine, x, OURS)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print rank 0's counts and functions as one JSON object")
    p.add_argument("--list", action="store_true", help="list every function")
    args = p.parse_args(argv)
    result = run_world(2, trace_rank, None, timeout=300)[0]
    if args.json:
        print(json.dumps(result))
        return 0
    for name, r in result.items():
        print(f"{name:16} {r['functions']:3} functions in {r['files']:2} files, {r['file_changes']} file changes")
        if args.list:
            for f in r["listed"]:
                print(f"         {f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
