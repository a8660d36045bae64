"""A training configuration's live bytes on one gloo rank, by phase: ours and FSDP1 alike.

``train_measured`` wraps ``Config``'s model (``fsdp_shell.memory.workload``) with one
implementation and trains it with its optimizer for ``steps`` steps under ``LiveBytes``
(everything from the model's construction on is counted), each forward, backward and optimizer
step a phase of its own; it returns the peak of each of ``PHASES`` over all steps and the bytes
still live after the last (``"after"``). ``measure`` is the same for several implementations in
turn, as ``fsdp_shell.cli.launch.run_world`` calls it on every rank.

Device meshes are made before the count starts and their rank tensors are never counted (the
world's, and the smaller groups' ``reshard_after_forward`` an int reshards to, which
``fully_shard`` takes from its cache): host objects of a few integers, on the CPU whatever the
device, so never device memory, and on gloo not FSDP's training memory either.

``around``, given the counter and the wrapped model, makes a context that the training steps
run inside: a caller's further measurements of the same run (the memory tests measure every
post-backward hook against its prediction that way).
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

import torch

from fsdp_shell.fsdp2.api import post_forward_mesh
from fsdp_shell.memory.live import LiveBytes
from fsdp_shell.memory.workload import Config, Impl, loss_of, optimizer_of, shard_per_block, world_mesh, wrap

if TYPE_CHECKING:
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

    from fsdp_shell.fsdp import FullyShardedDataParallel

__all__ = ["PHASES", "Around", "implementations", "measure", "train_measured"]

PHASES = ("forward", "backward", "optimizer", "after")
"""What a measurement reports, in bytes: the peak of every step's forward, backward and
optimizer step, and the bytes live after the last step."""

Around = Callable[[LiveBytes, "FullyShardedDataParallel | TorchFSDP"], AbstractContextManager[object]]
"""Given the counter and the wrapped model: a context for the training steps."""


def implementations(cfg: Config) -> tuple[Impl, ...]:
    """Ours and FSDP1, or ours alone where FSDP1 cannot run ``cfg`` (it refuses
    ``CPUOffload(offload_params=True)`` without an accelerator: it pins memory)."""
    return ("ours",) if cfg.offload else ("ours", "fsdp1")


def train_measured(cfg: Config, impl: Impl, *, rank: int, steps: int, around: Around | None = None) -> dict[str, int]:
    """``cfg`` trained for ``steps`` steps on this rank, wrapped by ``impl``: bytes by ``PHASES``
    (module docstring)."""
    gc.collect()
    per_block = impl in ("ours_fully_shard", "fsdp2")
    mesh = world_mesh(cfg) if per_block else None
    meshes = [] if mesh is None else [mesh]
    if mesh is not None and impl == "ours_fully_shard" and cfg.reshard_after_forward is not None:
        meshes.append(post_forward_mesh(mesh, cfg.reshard_after_forward))  # the one fully_shard takes (cached)
    with LiveBytes() as live:
        live.ignore(m._rank_map for m in meshes)  # what .mesh views (a new view each call)
        model = shard_per_block(impl, cfg, mesh) if per_block else wrap(impl, cfg)
        opt = optimizer_of(cfg, model.parameters())
        with contextlib.nullcontext() if around is None else around(live, model):  # type: ignore[arg-type]  # FSDP1 models only take one
            for step in range(steps):
                for micro in range(cfg.accumulate):
                    sync = micro == cfg.accumulate - 1 or cfg.sync_every_micro
                    with contextlib.nullcontext() if sync else _no_sync(model, per_block):
                        with live.phase("forward"):
                            loss = loss_of(model, cfg, rank, step)
                        with live.phase(f"backward {step}.{micro}"):
                            torch.autograd.backward(loss)
                        del loss
                with live.phase("optimizer"):
                    opt.step()
                    opt.zero_grad()
        out = {
            "forward": live.peaks["forward"],
            "backward": max(v for k, v in live.peaks.items() if k.startswith("backward")),
            "optimizer": live.peaks["optimizer"],
            "after": live.current,
        }
        del model, opt
    return out


@contextlib.contextmanager
def _no_sync(model: object, per_block: bool) -> Iterator[None]:
    """FSDP1's ``no_sync()``, or FSDP2's ``set_requires_gradient_sync(False)`` for the block."""
    if not per_block:
        with model.no_sync():  # type: ignore[attr-defined]  # both FSDP1 wrappers have it
            yield
        return
    model.set_requires_gradient_sync(False)  # type: ignore[attr-defined]  # both FSDPModules have it
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)  # type: ignore[attr-defined]  # both FSDPModules have it


def measure(rank: int, world: int, job: tuple[Config, int, tuple[Impl, ...]]) -> dict[Impl, dict[str, int]]:
    """On every rank of a world of ``job``'s configuration: ``train_measured`` for each of the
    implementations named (``implementations``: all that can run it), ``steps`` steps each, in
    turn."""
    cfg, steps, impls = job
    return {impl: train_measured(cfg, impl, rank=rank, steps=steps) for impl in impls}
