"""The demo's training worker: one rank of an FSDP run of its model (``TinyLM``, GPT-2 or Llama)
on standard-library bytes."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.tensor import DTensor
from tqdm import tqdm

from fsdp_core import CommHook, CPUOffload, Group, ShardingStrategy
from fsdp_core.plan.comm import ring_bytes
from fsdp_shell import comm_hooks
from fsdp_shell.demo import models
from fsdp_shell.demo.check import CheckReport, StepCheck
from fsdp_shell.demo.checkpoint import load_checkpoint, save_checkpoint
from fsdp_shell.demo.config import DemoConfig
from fsdp_shell.demo.data import Corpus, load_corpus
from fsdp_shell.demo.model import lm_loss
from fsdp_shell.fsdp import FullyShardedDataParallel
from fsdp_shell.fsdp2.api import FSDPModule, fully_shard
from fsdp_shell.fsdp2.state import state_of
from fsdp_shell.runtime.collectives import CollectiveKind
from fsdp_shell.runtime.device import current_accelerator

__all__ = ["DemoConfig", "RunResult", "run_rank"]


@dataclass
class RunResult:
    """What one rank reports back."""

    rank: int
    world: int
    start_step: int = 0
    losses: list[float] = field(default_factory=list)
    held_out: list[tuple[int, float]] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    comm_bytes: list[int] = field(default_factory=list)
    tokens_per_step: int = 0
    params: int = 0
    check: CheckReport | None = None
    """``--check``'s findings (rank 0's; ``fsdp_shell.demo.check``)."""
    units: int = 0


class Trained:
    """The model under training, whichever API sharded it: what a step asks of it."""

    def __init__(self, model: nn.Module, mesh: DeviceMesh) -> None:
        self.model = model
        self.mesh = mesh

    @property
    def fsdp1(self) -> FullyShardedDataParallel | None:
        return self.model if isinstance(self.model, FullyShardedDataParallel) else None

    def micro_batch(self, sync: bool) -> contextlib.AbstractContextManager[object]:
        """Around one micro-batch: without gradient sync unless ``sync`` (FSDP1's ``no_sync()``,
        ``fully_shard``'s ``set_requires_gradient_sync``)."""
        fsdp1 = self.fsdp1
        if fsdp1 is not None:
            return contextlib.nullcontext() if sync else fsdp1.no_sync()
        assert isinstance(self.model, FSDPModule)
        self.model.set_requires_gradient_sync(sync)
        return contextlib.nullcontext()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip the gradients' total norm to ``max_norm``; the norm before (a plain tensor)."""
        fsdp1 = self.fsdp1
        if fsdp1 is not None:
            return fsdp1.clip_grad_norm_(max_norm)
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        return norm.full_tensor() if isinstance(norm, DTensor) else norm

    def collective_counts(self) -> dict[CollectiveKind, int]:
        """Every collective this rank's units issued so far, by kind."""
        fsdp1 = self.fsdp1
        if fsdp1 is not None:
            return dict(fsdp1.collective_counts())
        state = state_of(self.model)
        return {} if state is None or state.ctx is None else dict(state.ctx.log.counts)

    @property
    def sizes(self) -> dict[Group, int]:
        """The ranks of the shard and replicate groups."""
        fsdp1 = self.fsdp1
        if fsdp1 is not None:
            replicate = 1 if fsdp1.replicate_group is None else fsdp1.replicate_group.size()
            return {Group.SHARD: fsdp1.process_group.size(), Group.REPLICATE: replicate}
        mesh = self.mesh
        return {Group.SHARD: mesh.size(mesh.ndim - 1), Group.REPLICATE: mesh.size(0) if mesh.ndim == 2 else 1}

    @property
    def units(self) -> int:
        if self.fsdp1 is not None:
            return sum(1 for m in self.model.modules() if isinstance(m, FullyShardedDataParallel))
        states = {id(s): s for s in map(state_of, self.model.modules()) if s is not None}
        return sum(1 for s in states.values() if s.group is not None)


def _mesh(cfg: DemoConfig, world: int, device_type: str) -> DeviceMesh:
    if cfg.strategy.is_hybrid:
        shard = cfg.shard_size or world
        return init_device_mesh(device_type, (world // shard, shard), mesh_dim_names=("replicate", "shard"))
    return init_device_mesh(device_type, (world,), mesh_dim_names=("shard",))


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def _hook(model: FullyShardedDataParallel, kind: CommHook) -> None:
    if kind is CommHook.NONE:
        return
    fn = {
        CommHook.ALLREDUCE: comm_hooks.allreduce_hook,
        CommHook.REDUCE_SCATTER: comm_hooks.reduce_scatter_hook,
        CommHook.FP16_COMPRESS: comm_hooks.fp16_compress_hook,
        CommHook.BF16_COMPRESS: comm_hooks.bf16_compress_hook,
    }[kind]
    model.register_comm_hook(comm_hooks.DefaultState(model.process_group), fn)


def _wire_bytes(
    before: Mapping[CollectiveKind, int], after: Mapping[CollectiveKind, int], sizes: dict[Group, int], hooked: str
) -> int:
    """The gradient reductions' bytes on the wire per rank between two readings of the
    collective counts, counted as the plans count them (``fsdp_core.plan.comm``): a comm hook as
    ``hooked``, the collective it runs."""
    total = 0
    for kind, calls in after.items():
        if kind.op == "all_gather":
            continue
        collective = kind.op if kind.op != "comm_hook" else hooked
        total += (calls - before.get(kind, 0)) * ring_bytes(collective, kind.numel, sizes[kind.group], kind.dtype)
    return total


def build_model(cfg: DemoConfig, mesh: DeviceMesh, device: torch.device) -> tuple[nn.Module, int]:
    """The sharded model (each ``Block`` a unit, then the root; the same seed gives the reference
    the same initial weights) and its number of parameters."""
    torch.manual_seed(cfg.seed)
    module, block = models.build(cfg.model)
    numel = sum(p.numel() for p in module.parameters())
    if cfg.api == "fully_shard":
        return _fully_shard(cfg, module.to(device), block, mesh), numel
    model = FullyShardedDataParallel(
        module,
        sharding_strategy=cfg.strategy,
        auto_wrap_policy={block},
        mixed_precision=cfg.mixed(),
        cpu_offload=CPUOffload(offload_params=cfg.offload),
        use_orig_params=cfg.use_orig_params,
        device_mesh=mesh,
        device_id=device,
    )
    _hook(model, cfg.comm_hook)
    return model, numel


def _fully_shard(cfg: DemoConfig, module: nn.Module, block: type[nn.Module], mesh: DeviceMesh) -> nn.Module:
    """``fully_shard`` on every block, then the root: the strategy's mesh, and after forward
    the parameters kept (``SHARD_GRAD_OP``, ``HYBRID_SHARD_ZERO2``) or freed."""
    mixed = cfg.mixed()
    policy = MixedPrecisionPolicy()
    if mixed is not None:
        policy = MixedPrecisionPolicy(param_dtype=mixed.param_dtype, reduce_dtype=mixed.reduce_dtype)
    offload: OffloadPolicy = CPUOffloadPolicy(pin_memory=False) if cfg.offload else OffloadPolicy()
    keep = cfg.strategy in (ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.HYBRID_SHARD_ZERO2)
    blocks = [m for m in module.modules() if isinstance(m, block)]
    for m in blocks:
        fully_shard(m, mesh=mesh, mp_policy=policy, offload_policy=offload, reshard_after_forward=not keep)
    fully_shard(module, mesh=mesh, mp_policy=policy, offload_policy=offload, reshard_after_forward=False)
    return module


def _held_out_loss(
    model: torch.nn.Module, corpus: Corpus, cfg: DemoConfig, rank: int, world: int, device: torch.device
) -> float:
    rows = cfg.batch_size
    total = torch.zeros((), device=device)
    with torch.no_grad():
        for k in range(4):
            x, y = corpus.batch(
                seed=cfg.seed, step=10_000 + k, micro=0, rows=rows * world, seq=cfg.model.seq, held_out=True
            )
            x, y = x[rank * rows : (rank + 1) * rows].to(device), y[rank * rows : (rank + 1) * rows].to(device)
            total += lm_loss(models.logits(model, x, cfg.model.arch), y)
    dist.all_reduce(total)
    return float(total) / (4 * world)


def run_rank(rank: int, world: int, cfg: DemoConfig) -> RunResult:
    """Train on this rank (inside an initialised process group) and report."""
    device = _device()
    mesh = _mesh(cfg, world, device.type)
    model, numel = build_model(cfg, mesh, device)
    trained = Trained(model, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    corpus = load_corpus()
    result = RunResult(rank=rank, world=world, units=trained.units, params=numel)
    if cfg.resume is not None:
        meta = load_checkpoint(Path(cfg.resume), model, opt)
        result.start_step = int(str(meta["step"]))
    rows, seq = cfg.batch_size, cfg.model.seq
    result.tokens_per_step = rows * world * seq * cfg.grad_accum
    # a comm hook is counted as the collective it runs: the all-reduce hook all-reduces the whole gradient
    hooked = "reduce_scatter" if cfg.strategy.is_sharded and cfg.comm_hook is not CommHook.ALLREDUCE else "all_reduce"
    sizes = trained.sizes
    bar = tqdm(
        total=cfg.steps,
        initial=result.start_step,
        disable=rank != 0 or cfg.quiet,
        unit="step",
        dynamic_ncols=True,
        leave=True,
        mininterval=0.5,
    )
    profiler = _profiler(cfg, rank)
    check = StepCheck(cfg, model, world, device) if cfg.check else None
    with profiler if profiler is not None else contextlib.nullcontext():
        for step in range(result.start_step, cfg.steps):
            counted = trained.collective_counts()
            start = time.perf_counter()
            step_loss = torch.zeros((), device=device)
            if check is not None:
                check.begin(step)
            for micro in range(cfg.grad_accum):
                x, y = corpus.batch(seed=cfg.seed, step=step, micro=micro, rows=rows * world, seq=seq)
                x, y = x[rank * rows : (rank + 1) * rows].to(device), y[rank * rows : (rank + 1) * rows].to(device)
                sync = micro == cfg.grad_accum - 1
                with trained.micro_batch(sync):
                    loss = lm_loss(models.logits(model, x, cfg.model.arch), y) / cfg.grad_accum
                    if check is None:
                        torch.autograd.backward(loss)
                    else:
                        check.backward(loss, x, y)
                step_loss += loss.detach()
            if check is not None:
                check.gradients()
            if cfg.clip is not None:
                norm = trained.clip_grad_norm_(cfg.clip)
                if check is not None:
                    check.clipped(norm)
            opt.step()
            if check is not None:
                check.stepped()
            opt.zero_grad()
            dist.all_reduce(step_loss)
            elapsed = time.perf_counter() - start
            result.losses.append(float(step_loss) / world)
            result.step_seconds.append(elapsed)
            result.comm_bytes.append(_wire_bytes(counted, trained.collective_counts(), sizes, hooked))
            if profiler is not None:
                profiler.step()
            if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps or step == result.start_step:
                result.held_out.append((step + 1, _held_out_loss(model, corpus, cfg, rank, world, device)))
            bar.set_postfix(
                ordered_dict={
                    "loss": f"{result.losses[-1]:.3f}",
                    "held_out": f"{result.held_out[-1][1]:.3f}",
                    "ms": f"{elapsed * 1e3:.0f}",
                    "tok_s": f"{result.tokens_per_step / elapsed:,.0f}",
                    "comm_MiB": f"{result.comm_bytes[-1] / 2**20:.2f}",
                }
            )
            bar.update(1)
    bar.close()
    if cfg.save is not None:
        directory = Path(cfg.save)
        directory.mkdir(parents=True, exist_ok=True)
        save_checkpoint(
            directory,
            model,
            opt,
            {
                "step": cfg.steps,
                "model": vars(cfg.model),
                "seed": cfg.seed,
                "strategy": cfg.strategy.name,
                "api": cfg.api,
                "world": world,
                "mixed_precision": cfg.mixed_precision,
                "use_orig_params": cfg.use_orig_params,
            },
        )
    if check is not None and rank == 0:
        result.check = check.report
    return result


def _profiler(cfg: DemoConfig, rank: int) -> torch.profiler.profile | None:
    if cfg.profile is None:
        return None
    directory = Path(cfg.profile)
    directory.mkdir(parents=True, exist_ok=True)

    def export(prof: torch.profiler.profile) -> None:
        prof.export_chrome_trace(str(directory / f"trace_rank{rank}.json"))

    activities = [torch.profiler.ProfilerActivity.CPU]
    accelerator = current_accelerator()
    if accelerator is not None and accelerator.type.upper() in torch.profiler.ProfilerActivity.__members__:
        activities.append(torch.profiler.ProfilerActivity.__members__[accelerator.type.upper()])
    return torch.profiler.profile(
        activities=activities,
        on_trace_ready=export,
        schedule=torch.profiler.schedule(wait=1, warmup=1, active=3, repeat=1),
    )
