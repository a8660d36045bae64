"""``fsdp_shell.fully_shard`` against PyTorch's own ``fully_shard`` in the same gloo world: the
same model, initial values and batches, one optimizer each; after every step the losses (relative,
above 1) and then every parameter (``full_tensor()``) agree to 1e-6, in fp32 and in bf16 (against
FSDP2's own bf16). On 4 ranks some reduced gradients differ from FSDP2's in their last bits from
the first backward (up to 7e-9; the division is by a power of two, exact), which a loss near 9
shows as 2 ulps.

The cases cover the options pairwise: 2 and 4 ranks; 1-D and 2-D meshes (a shard group of one
included); ``reshard_after_forward`` None, True, False and 2 (resharding to pairs of ranks after
forward, ZeRO++'s hpZ); bf16 parameters with fp32 reduction and an fp32 ``output_dtype``;
gradient accumulation without sync, and HSDP without the all-reduce, until the last
micro-batch, and into the ``.grad`` a synced micro-batch left; frozen and ignored parameters;
tied embeddings; a dimension-0 size that does not divide (9 rows) and ``Shard(1)``;
``CPUOffloadPolicy(pin_memory=False)``; meta-device init (``to_empty``, then rank 0's full state
dict broadcast); activation checkpointing and ``torch.compile`` per block before sharding;
``clip_grad_norm_`` on the DTensor gradients; tiny Hugging Face GPT-2 (tied embeddings) and Llama
(grouped as torchtitan groups it). Checkpoints saved by either library with
``torch.distributed.checkpoint`` load into the other, which trains on identically. Exact live
bytes (``LiveBytes``) are the same from run to run and at most FSDP2's at every phase; the HSDP
all-reduce overlaps later backward compute.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import async_save as dcp_async_save
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Shard

from fsdp_core import Gather, Group
from fsdp_shell import FSDPModule, fully_shard
from fsdp_shell.fsdp2.state import state_of
from fsdp_shell.memory.measure import PHASES, train_measured
from fsdp_shell.memory.workload import HF_VOCAB, Config, hf_model
from tests.worlds.dist_harness import run_world
from tests.worlds.runtime_overlap_cases import MEASURED_STEPS, hybrid_overlap

VOCAB, DIM = 16, 8


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, 9)  # 9 rows: uneven on 2 and 4 ranks
        self.down = nn.Linear(9, DIM, bias=False)
        self.scale = nn.Parameter(torch.randn(1))  # one row: the other ranks hold none
        self.wide = nn.Parameter(torch.randn(3, DIM) / 4)  # Shard(1): 8 columns divide

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.down(torch.relu(self.up(x))) * self.scale
        out: torch.Tensor = x + y + (y[..., :3] @ self.wide)
        return out


class Net(nn.Module):
    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block() for _ in range(3)])
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for b in self.blocks:
            x = b(x)
        out: torch.Tensor = self.head(x)
        return out


@dataclass(frozen=True)
class Case:
    world: int
    mesh: tuple[int, ...]
    reshard: bool | int | None = None
    """``reshard_after_forward``; an int reshards to groups of that many ranks (ZeRO++'s hpZ)."""
    bf16: bool = False
    micro: int = 1
    """Micro-batches per step; all but the last without gradient sync (1-D) or all-reduce (2-D)."""
    sync_every_micro: bool = False
    """Every micro-batch reduces (the next accumulates into the ``.grad`` the last one left)."""
    frozen: bool = False
    """Freeze the first block's ``up``, and leave the last block's ``scale`` out (ignored)."""
    tied: bool = False
    checkpointed: bool = False
    """Each block under ``checkpoint_wrapper`` (activation checkpointing) before sharding."""
    compiled: bool = False
    """Each block ``compile()``d before sharding (torchtitan's order)."""
    clip: bool = False
    """``torch.nn.utils.clip_grad_norm_`` before every optimizer step."""
    offload: bool = False
    """``CPUOffloadPolicy(pin_memory=False)`` (on the CPU the device is the host)."""
    prefetch: bool = False
    """Explicit prefetching: each block's forward issues the next block's all-gather, each
    block's backward the previous one's."""
    embedding_unit: bool = False
    """The embedding a unit of its own, not gathered for backward (``set_unshard_in_backward``)."""
    meta: bool = False
    """Built on the meta device, sharded, ``to_empty(device="cpu")``, then given rank 0's initial
    values (``set_model_state_dict(..., broadcast_from_rank0=True)``)."""
    dim1: bool = True
    """The 3 x 8 parameter is ``Shard(1)`` (else ``Shard(0)``, as every other). PyTorch's FSDP2
    cannot reshard a ``Shard(1)`` parameter to a smaller group (its ``to_sharded_post_forward``
    raises: storage out of bounds), so with an int ``reshard`` FSDP2 then reshards fully, which
    gives the same values."""
    steps: int = 3
    extra: dict[str, Any] = field(default_factory=dict)
    device: str = "cpu"
    """The mesh's device type: ``cuda`` for ranks sharing one GPU over gloo
    (``tests/device/gpu_worlds.py``); the model and its batches go there."""

    @property
    def id(self) -> str:
        parts = [f"w{self.world}", "x".join(map(str, self.mesh)), f"raf-{self.reshard}"]
        flags = [("bf16", self.bf16), ("frozen", self.frozen), ("tied", self.tied), ("ac", self.checkpointed)]
        flags += [("compiled", self.compiled), ("clip", self.clip), ("meta", self.meta), ("offload", self.offload)]
        flags += [("embedding-unit", self.embedding_unit), ("prefetch", self.prefetch)]
        flags += [("dim0-only", not self.dim1)]
        parts += [name for name, on in flags if on]
        if self.micro > 1:
            parts.append(f"micro{self.micro}" + ("-synced" if self.sync_every_micro else ""))
        return "-".join(parts)


CASES = [
    Case(2, (2,)),
    Case(2, (2,), reshard=False, bf16=True),
    Case(4, (4,), reshard=True, micro=2, offload=True),
    Case(4, (2, 2), bf16=True, micro=2),
    Case(2, (2,), frozen=True, tied=True),
    Case(4, (4, 1), reshard=False, frozen=True),
    Case(4, (1, 4), tied=True, bf16=True, checkpointed=True, clip=True),
    Case(2, (2,), compiled=True, clip=True, steps=2),
    Case(2, (2,), micro=2, sync_every_micro=True, bf16=True),
    Case(2, (2,), meta=True, tied=True, bf16=True),
    Case(4, (2, 2), embedding_unit=True, reshard=True),
    Case(2, (2,), prefetch=True, bf16=True, micro=2),
    Case(4, (4,), reshard=2, bf16=True, micro=2, dim1=False),
    Case(4, (1, 4), reshard=2, tied=True, prefetch=True),
]


def _placement(param: nn.Parameter) -> Shard | None:
    return Shard(1) if param.shape == (3, DIM) else None


def _build(case: Case, mesh: DeviceMesh, shard: Any, base: Net) -> tuple[Net, torch.optim.Optimizer]:
    with torch.device("meta") if case.meta else contextlib.nullcontext():
        model = Net(case.tied)
    if not case.meta:
        model.load_state_dict(base.state_dict())
    ignored: set[nn.Parameter] = set()
    if case.frozen:
        first, last = model.blocks[0], model.blocks[-1]
        assert isinstance(first, Block) and isinstance(last, Block)
        first.up.requires_grad_(False)
        ignored = {last.scale}
    kw: dict[str, Any] = {"mesh": mesh}
    if case.offload:
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    if case.reshard is not None:
        kw["reshard_after_forward"] = case.reshard
        if case.dim1 and shard is torch_fully_shard and not isinstance(case.reshard, bool):
            kw["reshard_after_forward"] = True  # see ``Case.dim1``
    blocks, root = MixedPrecisionPolicy(), MixedPrecisionPolicy()
    if case.bf16:  # the root's logits come out in fp32
        blocks = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        root = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32)
    for i, block in enumerate(model.blocks):
        b = model.blocks[i] = checkpoint_wrapper(block) if case.checkpointed else block
        if case.compiled:
            b.compile()
        placement = _placement if case.dim1 else None
        shard(b, shard_placement_fn=placement, ignored_params=ignored, mp_policy=blocks, **kw)
    if case.embedding_unit:
        shard(model.embed, mp_policy=blocks, **kw)
    shard(model, mp_policy=root, **kw)
    if case.embedding_unit:
        model.embed.set_unshard_in_backward(False)  # type: ignore[operator]  # FSDPModule's (both libraries')
    if case.prefetch:
        blocks_ = list(model.blocks)
        for a, b in itertools.pairwise(blocks_):
            a.set_modules_to_forward_prefetch([b])  # type: ignore[operator]  # FSDPModule's (both libraries')
            b.set_modules_to_backward_prefetch([a])  # type: ignore[operator]  # FSDPModule's (both libraries')
    if case.meta:
        model.to_empty(device=case.device)
        full = base.state_dict() if dist.get_rank() == 0 else {}  # rank 0's, broadcast to the others
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)


def _step(case: Case, model: Net, opt: torch.optim.Optimizer, batches: list[torch.Tensor]) -> float:
    total = 0.0
    for k, tokens in enumerate(batches):
        last = k == len(batches) - 1
        if case.micro > 1 and not case.sync_every_micro:
            if len(case.mesh) == 2 and case.mesh[0] > 1:
                model.set_requires_all_reduce(last)  # type: ignore[operator]  # FSDPModule's (both libraries')
            else:
                model.set_requires_gradient_sync(last)  # type: ignore[operator]  # FSDPModule's (both libraries')
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB).float(), tokens[:, 1:].reshape(-1)) / len(batches)
        loss.backward()  # type: ignore[no-untyped-call]  # unannotated in torch
        total += loss.item()
    if case.clip:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    opt.step()
    opt.zero_grad()
    return total


def train_against_fsdp2(rank: int, world: int, case: Case) -> list[str]:
    """Problems found on this rank (none when both libraries trained alike)."""
    names = ("replicate", "shard")[-len(case.mesh) :]
    mesh = init_device_mesh(case.device, case.mesh, mesh_dim_names=names)
    torch.manual_seed(0)
    base = Net(case.tied)
    theirs, their_opt = _build(case, mesh, torch_fully_shard, base)
    ours, our_opt = _build(case, mesh, fully_shard, base)
    problems: list[str] = []
    issued: list[bool] = []
    if case.prefetch:  # when the first block runs, its prefetch of the second has been issued
        nxt = state_of(ours.blocks[1])
        assert nxt is not None and nxt.group is not None
        group = nxt.group
        ours.blocks[0].register_forward_pre_hook(
            lambda *_: issued.append(group._in_flight is not None or group.gathered)
        )
    held: list[list[int]] = []
    if isinstance(case.reshard, int) and not isinstance(case.reshard, bool):  # after forward, before backward
        groups = [s.group for s in map(state_of, ours.blocks) if s is not None and s.group is not None]
        ours.register_forward_hook(lambda *_: held.append([g.post_forward_numel * case.reshard for g in groups]))
        want_held = [g.layout.padded_numel for g in groups]
    if not isinstance(ours, FSDPModule) or type(ours).__name__ != "FSDPNet":
        problems.append(f"the root's class is {type(ours).__name__}, not an FSDPModule FSDPNet")
    root = state_of(ours)
    assert root is not None
    gathered_last = 0
    for step in range(case.steps):
        gen = torch.Generator().manual_seed(1000 * step + rank)
        batches = [torch.randint(0, VOCAB, (3, 7), generator=gen).to(case.device) for _ in range(case.micro)]
        before = _all_gathers(root)
        a, b = _step(case, theirs, their_opt, batches), _step(case, ours, our_opt, batches)
        gathered_last = _all_gathers(root) - before
        if abs(a - b) > 1e-6 * max(1.0, abs(a)):  # relative: at 8.85 one fp32 ulp is 9.5e-7
            problems.append(f"step {step}: loss {b} where FSDP2's is {a}")
    problems += _collectives(case, ours)
    assert root.ctx is not None
    schedule = root.ctx.gathers.schedule  # the last iteration's, planned from the one before
    planned = sum(isinstance(a, Gather) for step in schedule.steps for a in step.actions)
    if not schedule.steps or gathered_last != case.micro * planned:
        problems.append(f"the last step all-gathered {gathered_last} times; its schedule plans {planned} per iteration")
    if held and held != [want_held] * len(held):  # each block keeps 1/reshard of its gathered parameters
        problems.append(f"held after forward x {case.reshard}: {held}, expected {want_held} every forward")
    if case.prefetch and not (issued and all(issued)):
        problems.append(f"the second block's all-gather was not issued by the first block's forward: {issued}")
    for (name, p), (name2, q) in zip(theirs.named_parameters(), ours.named_parameters(), strict=True):
        if name != name2 or type(p) is not type(q):
            problems.append(f"parameter {name2} ({type(q).__name__}) where FSDP2 has {name} ({type(p).__name__})")
            continue
        their_value, our_value = p.detach(), q.detach()
        if isinstance(p, DTensor) and isinstance(q, DTensor):
            if p.placements != q.placements or p.to_local().shape != q.to_local().shape:
                problems.append(
                    f"{name}: placed {q.placements} {tuple(q.to_local().shape)} where FSDP2 has "
                    f"{p.placements} {tuple(p.to_local().shape)}"
                )
            their_value, our_value = p.full_tensor().detach(), q.full_tensor().detach()
        worst = (their_value - our_value).abs().max().item()
        if worst > 1e-6:
            problems.append(f"{name}: differs from FSDP2's by {worst:.3g}")
    return problems


def _all_gathers(state: Any) -> int:
    """Our all-gathers so far (the root's collective log)."""
    return sum(n for kind, n in state.ctx.log.counts.items() if kind.op == "all_gather") if state.ctx else 0


def _collectives(case: Case, ours: Net) -> list[str]:
    """Our reductions, counted: every unit (the three blocks and the root; the embedding where it
    is one) reduce-scatters once per step, or once per micro-batch where HSDP only defers the
    all-reduce; the replicate all-reduce runs once per step. An embedding not gathered for
    backward is gathered once per step, each block twice."""
    state = state_of(ours)
    assert state is not None and state.ctx is not None
    counts: dict[tuple[str, Group], int] = {}
    for kind, n in state.ctx.log.counts.items():
        counts[(kind.op, kind.group)] = counts.get((kind.op, kind.group), 0) + n
    two_d = len(case.mesh) == 2  # a 2-D mesh all-reduces over its replicate dimension, of one rank too
    per_step = case.micro if (two_d and case.mesh[0] > 1) or case.sync_every_micro else 1
    units = 5 if case.embedding_unit else 4
    want = {("reduce_scatter", Group.SHARD): units * case.steps * per_step}
    if two_d:
        want[("all_reduce", Group.REPLICATE)] = units * case.steps * (case.micro if case.sync_every_micro else 1)
    if case.embedding_unit:  # gathered for forward only, the blocks for backward too
        gathers = sum(n for k, n in counts.items() if k[0] == "all_gather")
        per_step = 1 + 2 * 3 + (2 if case.reshard else 1)  # the root, kept after forward unless told
        if gathers != per_step * case.steps:
            return [f"{gathers} all-gathers, expected {per_step * case.steps}"]
    got = {k: v for k, v in counts.items() if k[0] != "all_gather"}
    return [] if got == want else [f"reductions {got}, expected {want}"]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_fully_shard_trains_as_pytorchs_fully_shard(case: Case) -> None:
    assert run_world(case.world, train_against_fsdp2, case, timeout=240) == [[]] * case.world


# -- with tensor parallelism on a (dp, tp) mesh -----------------------------------------------------


class TPBlock(nn.Module):
    """Parallelized as torchtitan parallelizes a block: the norm sequence-parallel (its weight's
    gradient comes out ``Partial`` and is made ``Replicate`` before FSDP reduces it), ``up``
    column-parallel (5 rows per tp rank, then 3 and 2 per dp rank), ``down`` row-parallel back to
    the sequence shard."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, 10)
        self.down = nn.Linear(10, DIM)
        self.gain = nn.Parameter(torch.rand(DIM) + 0.5)  # not tensor-parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.down(torch.relu(self.up(self.norm(x)))) * self.gain
        return out


class TPNet(nn.Module):
    """Embedding and head not tensor-parallel; the blocks see this tp rank's part of the sequence."""

    def __init__(self, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([TPBlock() for _ in range(2)])
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.tp_rank, self.tp_size = tp_rank, tp_size

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens).chunk(self.tp_size, dim=1)[self.tp_rank]
        for b in self.blocks:
            x = b(x)
        out: torch.Tensor = self.head(x)
        return out


def tp_against_fsdp2(rank: int, world: int, arg: None) -> list[str]:
    """FSDP on the ``dp`` dimension of a 2 x 2 ``(dp, tp)`` mesh, each block first parallelized
    with torch's ``parallelize_module`` on ``tp`` (torchtitan's order): both libraries, the same
    losses and parameters, each placed as FSDP2 places it (``_StridedShard`` where both shard
    dimension 0); two micro-batches, the first without gradient sync."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    base = TPNet()
    models = []
    tp_rank = mesh["tp"].get_local_rank()
    plan = {
        "norm": SequenceParallel(),
        "up": ColwiseParallel(input_layouts=Shard(1)),
        "down": RowwiseParallel(output_layouts=Shard(1)),
    }
    for shard in (torch_fully_shard, fully_shard):
        model = TPNet(tp_rank, 2)
        model.load_state_dict(base.state_dict())
        for block in model.blocks:
            parallelize_module(block, mesh["tp"], plan)
            shard(block, mesh=mesh["dp"])
        shard(model, mesh=mesh["dp"])
        models.append((model, torch.optim.AdamW(model.parameters(), lr=1e-2)))
    problems: list[str] = []
    dp_rank = mesh["dp"].get_local_rank()
    for step in range(3):
        gen = torch.Generator().manual_seed(1000 * step + dp_rank)  # the same batches across tp
        batches = [torch.randint(0, VOCAB, (3, 7), generator=gen) for _ in range(2)]
        losses = []
        for model, opt in models:
            total = 0.0
            for k, tokens in enumerate(batches):
                model.set_requires_gradient_sync(k == 1)  # type: ignore[operator]  # FSDPModule's (both libraries')
                logits = model(tokens[:, :-1])  # of this tp rank's 3 of the 6 positions
                targets = tokens[:, 1:].chunk(2, dim=1)[tp_rank]
                loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1)) / 2
                loss.backward()  # type: ignore[no-untyped-call]  # unannotated in torch
                total += loss.item()
            opt.step()
            opt.zero_grad()
            losses.append(total)
        if abs(losses[0] - losses[1]) > 1e-6 * max(1.0, abs(losses[0])):
            problems.append(f"step {step}: loss {losses[1]} where FSDP2's is {losses[0]}")
    (theirs, _), (ours, _) = models
    for (name, p), (_, q) in zip(theirs.named_parameters(), ours.named_parameters(), strict=True):
        assert isinstance(p, DTensor) and isinstance(q, DTensor)
        if (p.device_mesh.mesh_dim_names, p.placements) != (q.device_mesh.mesh_dim_names, q.placements):
            problems.append(f"{name}: placed {q.placements} on {q.device_mesh} where FSDP2 has {p.placements}")
        elif p.to_local().shape != q.to_local().shape:
            problems.append(f"{name}: local {tuple(q.to_local().shape)} where FSDP2's is {tuple(p.to_local().shape)}")
        worst = (p.full_tensor() - q.full_tensor()).abs().max().item()
        if worst > 1e-6:
            problems.append(f"{name}: differs from FSDP2's by {worst:.3g}")
    return problems


def test_fully_shard_on_the_dp_dimension_composes_with_tensor_parallelism_as_pytorchs() -> None:
    assert run_world(4, tp_against_fsdp2, None, timeout=240) == [[]] * 4


# -- an all-reduce hook: HSDP by hand --------------------------------------------------------------


def hook_against_fsdp2(rank: int, world: int, arg: None) -> list[str]:
    """``set_all_reduce_hook`` on every unit of a model sharded over pairs of ranks, the hook
    averaging the reduced gradient across the pairs (HSDP by hand, as with a replicate group of
    one's own): both libraries call it as often, then train to the same losses and parameters,
    which native HSDP on a 2 x 2 mesh also reaches."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    across = mesh["replicate"].get_group()
    torch.manual_seed(0)
    base = Net(tied=False)
    calls = {"theirs": 0, "ours": 0}

    def averaging(who: str) -> Any:
        def hook(grad: torch.Tensor) -> None:
            calls[who] += 1
            dist.all_reduce(grad, op=dist.ReduceOp.AVG, group=across)

        return hook

    models = []
    for who, shard, on in (("theirs", torch_fully_shard, mesh["shard"]), ("ours", fully_shard, mesh["shard"])):
        model, opt = _build(Case(4, (2,)), on, shard, base)
        for m in model.modules():
            if isinstance(m, FSDPModule) or hasattr(m, "set_all_reduce_hook"):
                m.set_all_reduce_hook(averaging(who))  # type: ignore[operator]  # FSDPModule's (both libraries')
        models.append((model, opt))
    native = _build(Case(4, (2, 2)), mesh, fully_shard, base)
    problems: list[str] = []
    for step in range(3):
        gen = torch.Generator().manual_seed(1000 * step + rank)
        batches = [torch.randint(0, VOCAB, (3, 7), generator=gen)]
        losses = [_step(Case(4, (2,)), model, opt, batches) for model, opt in (*models, native)]
        if max(losses) - min(losses) > 1e-6 * max(1.0, abs(losses[0])):
            problems.append(f"step {step}: losses FSDP2 {losses[0]}, ours {losses[1]}, ours native HSDP {losses[2]}")
    if calls["ours"] != calls["theirs"] or calls["ours"] != 4 * 3:
        problems.append(f"hook calls: ours {calls['ours']}, FSDP2's {calls['theirs']}, expected 4 units x 3 steps")
    (theirs, _), (ours, _), (hsdp, _) = (*models, native)
    for (name, p), (_, q), (_, h) in zip(
        theirs.named_parameters(), ours.named_parameters(), hsdp.named_parameters(), strict=True
    ):
        assert isinstance(p, DTensor) and isinstance(q, DTensor) and isinstance(h, DTensor)
        worst = max(
            (p.full_tensor() - q.full_tensor()).abs().max().item(),
            (q.full_tensor() - h.full_tensor()).abs().max().item(),
        )
        if worst > 1e-6:
            problems.append(f"{name}: differs by {worst:.3g}")
    return problems


def test_an_all_reduce_hook_is_called_as_pytorchs_and_averages_across_replicas_as_hsdp() -> None:
    assert run_world(4, hook_against_fsdp2, None, timeout=240) == [[]] * 4


# -- checkpoints interchange with PyTorch's FSDP2 ---------------------------------------------------


def _train(model: Net, opt: torch.optim.Optimizer, rank: int, steps: int, seed: int) -> None:
    for step in range(steps):
        tokens = torch.randint(0, VOCAB, (3, 7), generator=torch.Generator().manual_seed(seed + 100 * step + rank))
        F.cross_entropy(model(tokens[:, :-1]).reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)).backward()  # type: ignore[no-untyped-call]  # unannotated in torch
        opt.step()
        opt.zero_grad()


def checkpoints_interchange(rank: int, world: int, path: str) -> list[str]:
    """Save with one library (model and AdamW state, ``torch.distributed.checkpoint``; ours with
    ``async_save``), load into the other built from different initial values, train both on:
    every parameter agrees."""

    mesh = init_device_mesh("cpu", (world,))
    case = Case(world, (world,))
    problems = []
    for saver, loader, name in ((fully_shard, torch_fully_shard, "ours"), (torch_fully_shard, fully_shard, "FSDP2")):
        torch.manual_seed(0)
        src, src_opt = _build(case, mesh, saver, Net(case.tied))
        _train(src, src_opt, rank, 2, seed=0)
        with torch.no_grad():
            src(torch.zeros(1, 2, dtype=torch.long))  # an eval forward leaves the root gathered
        saved = src.state_dict()
        if not all(isinstance(v, DTensor) for v in saved.values()):
            problems.append(f"{name}'s state_dict() after a forward holds plain tensors")
        ckpt = f"{path}/{name}"
        state = {"model": get_model_state_dict(src), "optim": get_optimizer_state_dict(src, src_opt)}
        if saver is fully_shard:  # ours saves asynchronously, on a process group of its own as DCP asks
            future = dcp_async_save(state, checkpoint_id=ckpt, process_group=dist.new_group(backend="gloo"))
            assert isinstance(future, Future)
            future.result()
        else:
            dcp_save(state, checkpoint_id=ckpt)
        torch.manual_seed(1)
        dst, dst_opt = _build(case, mesh, loader, Net(case.tied))
        model_state, optim_state = get_model_state_dict(dst), get_optimizer_state_dict(dst, dst_opt)
        dcp_load({"model": model_state, "optim": optim_state}, checkpoint_id=ckpt)
        set_model_state_dict(dst, model_state)
        set_optimizer_state_dict(dst, dst_opt, optim_state)
        _train(src, src_opt, rank, 2, seed=7)
        _train(dst, dst_opt, rank, 2, seed=7)
        for (key, p), q in zip(src.named_parameters(), dst.parameters(), strict=True):
            assert isinstance(p, DTensor) and isinstance(q, DTensor)
            worst = (p.full_tensor() - q.full_tensor()).abs().max().item()
            if worst > 1e-6:
                problems.append(f"saved by {name}: {key} differs by {worst:.3g} after two more steps")
    return problems


def test_checkpoints_interchange_with_pytorchs_fsdp2_both_ways(tmp_path: Any) -> None:
    assert run_world(2, checkpoints_interchange, str(tmp_path), timeout=240) == [[], []]


# -- Hugging Face models -----------------------------------------------------------------------------


def _hf_sharded(kind: str, shard: Any, mesh: DeviceMesh) -> nn.Module:
    """The tiny model of ``kind``: GPT-2 per block then the root (its output layer tied to its
    embedding, both in the root's unit); Llama grouped as torchtitan groups it: the embedding,
    each layer, ``[norm, output]``, then the root."""
    model, block = hf_model(kind)
    if kind == "llama":
        inner: Any = model.model
        shard(inner.embed_tokens, mesh=mesh)
        for layer in inner.layers:
            shard(layer, mesh=mesh)
        shard([inner.norm, model.lm_head], mesh=mesh)
    else:
        for m in [m for m in model.modules() if isinstance(m, block)]:
            shard(m, mesh=mesh)
    shard(model, mesh=mesh)
    return model


def hf_against_fsdp2(rank: int, world: int, kind: str) -> list[str]:
    """Problems on this rank (none when both libraries trained the model alike)."""
    mesh = init_device_mesh("cpu", (world,))
    models = [_hf_sharded(kind, shard, mesh) for shard in (torch_fully_shard, fully_shard)]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in models]
    problems = []
    for step in range(3):
        ids = torch.randint(0, HF_VOCAB, (2, 16), generator=torch.Generator().manual_seed(10 * step + rank))
        losses = []
        for model, opt in zip(models, opts):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        if abs(losses[0] - losses[1]) > 1e-6:
            problems.append(f"step {step}: loss {losses[1]} where FSDP2's is {losses[0]}")
    for (name, p), q in zip(models[0].named_parameters(), models[1].parameters(), strict=True):
        assert isinstance(p, DTensor) and isinstance(q, DTensor)
        worst = (p.full_tensor() - q.full_tensor()).abs().max().item()
        if worst > 1e-6:
            problems.append(f"{name}: differs from FSDP2's by {worst:.3g}")
    return problems


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_hugging_face_models_train_as_with_pytorchs_fully_shard(kind: str) -> None:
    assert run_world(2, hf_against_fsdp2, kind, timeout=240) == [[], []]


# -- live bytes ----------------------------------------------------------------------------------


def live_bytes(rank: int, world: int, cfg: Config) -> list[str]:
    """Problems on this rank: ours measured twice must agree to the byte, and hold at most
    FSDP2's bytes at every phase (``fsdp_shell.memory.measure``: exact live storage bytes)."""
    first, second = (train_measured(cfg, "ours_fully_shard", rank=rank, steps=2) for _ in range(2))
    theirs = train_measured(cfg, "fsdp2", rank=rank, steps=2)
    problems = [] if first == second else [f"ours differ between runs: {first} then {second}"]
    problems += [f"{k}: {first[k]:,} bytes where FSDP2 holds {theirs[k]:,}" for k in PHASES if first[k] > theirs[k]]
    return problems


@pytest.mark.parametrize(
    "cfg", [Config("FULL_SHARD", bf16=True, accumulate=2), Config("HYBRID_SHARD")], ids=["bf16-no_sync", "hybrid"]
)
def test_live_bytes_are_repeatable_and_at_most_fsdp2s(cfg: Config) -> None:
    assert run_world(cfg.world, live_bytes, cfg, timeout=240) == [[]] * cfg.world


# -- the HSDP all-reduce overlaps later backward compute -----------------------------------------


def test_the_hsdp_all_reduce_runs_during_later_backward_compute() -> None:
    """The same plan and runtime as the FSDP1 API's (``tests/worlds/test_runtime_gloo.py``): each
    unit's replicate all-reduce runs on the lane while the host computes later units' backward;
    their wall-clock intervals intersect."""
    for rank, seen in enumerate(run_world(2, hybrid_overlap, "fully_shard", timeout=300)):
        overlapped = [(s, e) for s, e in seen.all_reduces if any(bs < e and s < be for bs, be in seen.backward)]
        assert len(overlapped) >= MEASURED_STEPS, f"rank {rank}: {seen}"


# -- a rank that stops ---------------------------------------------------------------------------


def one_rank_stops(rank: int, world: int, arg: None) -> str:
    """Rank 1 trains one step and stops; rank 0 goes on. Rank 0 must raise
    ``CollectiveTimeoutError`` naming its step and unit when the shard group's timeout (4 s)
    expires (or when the stopped rank's connection closes), not hang."""
    from datetime import timedelta

    from torch.distributed.device_mesh import DeviceMesh

    from fsdp_shell.safety.timeouts import CollectiveTimeoutError

    group = dist.new_group(timeout=timedelta(seconds=4))
    mesh = DeviceMesh.from_group(group, "cpu")
    torch.manual_seed(0)
    model, opt = _build(Case(world, (world,)), mesh, fully_shard, Net(tied=False))
    _train(model, opt, rank, 1, seed=0)
    if rank == 1:
        return ""
    try:
        _train(model, opt, rank, 1, seed=1)
    except CollectiveTimeoutError as error:
        return str(error)
    return "no error"


def test_a_rank_that_stops_is_a_clear_error_in_bounded_time() -> None:
    started = time.monotonic()
    message, _ = run_world(2, one_rank_stops, None, timeout=60, fresh=True)
    assert time.monotonic() - started < 45
    assert message.startswith("FSDP: rank 0 gave up waiting for the other ranks in the "), message
    assert "forward of the unit of Net (holding embed.weight" in message and "a rank stopped, died" in message, message


# -- the all-gather memory model against the runtime ---------------------------------------------


class Odd(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(9, 6))  # uneven rows
        self.b = nn.Parameter(torch.randn(9))
        self.v = nn.Parameter(torch.randn(4, 8))  # Shard(1): a whole tensor and a concatenation too

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = (x @ self.w.T + self.b)[..., :4] @ self.v
        return out


def gather_bytes_measured(rank: int, world: int, bf16: bool) -> list[str]:
    """One unit's issue, await and reshard measured with ``LiveBytes`` (peak and net bytes of
    each, on this rank, after a first gather) against ``GatherWalk`` with
    ``per_param_gather_bytes``."""
    from fsdp_core.memory import GatherWalk, per_param_gather_bytes
    from fsdp_core.unshard.schedule import AwaitGather, Gather, Reshard
    from fsdp_shell.fsdp2.state import lazy_init
    from fsdp_shell.memory import LiveBytes

    torch.manual_seed(0)
    model = Odd()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16) if bf16 else MixedPrecisionPolicy()
    fully_shard(model, mp_policy=mp, shard_placement_fn=lambda p: Shard(1) if p.shape == (4, 8) else None)
    state = state_of(model)
    assert state is not None and state.group is not None
    group, runtime = state.group, lazy_init(state).runtime(state.mesh)
    walk = GatherWalk([per_param_gather_bytes(group.layout, group.dtypes.compute)])
    problems = []
    with LiveBytes() as live:
        group.unshard(runtime)  # a first cycle: the mode counts a storage from the first op that touches it
        group.free_unsharded()
        steps: list[tuple[Gather | AwaitGather | Reshard, Callable[[], None]]] = [
            (Gather(unit=0), lambda: group.start_unshard(runtime)),
            (AwaitGather(unit=0), lambda: group.unshard(runtime)),
            (Reshard(unit=0), group.free_unsharded),
            (Gather(unit=0), lambda: group.start_unshard(runtime)),
            (Reshard(unit=0), group.free_unsharded),  # a gather no one waited for
        ]
        for action, run in steps:
            with live.window() as w:
                run()
            measured, modeled = (w.peak - w.start, w.end - w.start), walk.run_all([action])
            if measured != modeled:
                problems.append(f"{type(action).__name__}: measured (peak, net) {measured}, modeled {modeled}")
    return problems


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_the_gather_memory_model_is_what_the_runtime_holds(bf16: bool) -> None:
    assert run_world(2, gather_bytes_measured, bf16, timeout=120) == [[], []]


def optimizer_bytes_measured(rank: int, world: int, foreach: bool) -> list[str]:
    """AdamW on a ``fully_shard`` unit's DTensor parameters (rank 1 of 4 holds 3 of 9 rows, rank 3
    none): the state its first step makes and the most a later step holds above it, measured
    with ``LiveBytes``, against ``per_param_optimized_tensors`` and the optimizer formulas."""
    from fsdp_core.memory import OptimizerKind, OptimizerSpec, per_param_optimized_tensors
    from fsdp_core.memory.optimizer import optimizer_state_bytes, optimizer_step_bytes
    from fsdp_shell.memory import LiveBytes

    torch.manual_seed(0)
    model = Odd()
    fully_shard(model, shard_placement_fn=lambda p: Shard(1) if p.shape == (4, 8) else None)
    state = state_of(model)
    assert state is not None and state.group is not None
    tensors = per_param_optimized_tensors(state.group.layout, rank, torch.float32)
    spec = OptimizerSpec(kind=OptimizerKind.ADAMW, foreach=foreach)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=foreach)
    with LiveBytes() as live:
        model(torch.randn(2, 6)).sum().backward()
        with live.window() as first:
            opt.step()
        with live.window() as later:
            opt.step()
    got = (first.end - first.start, later.peak - later.start)
    want = (optimizer_state_bytes(spec, tensors, host_is_device=True), optimizer_step_bytes(spec, tensors))
    return [] if got == want else [f"rank {rank}: measured (state, step) {got}, modeled {want}"]


@pytest.mark.parametrize("foreach", [False, True], ids=["single-tensor", "foreach"])
def test_the_optimizer_memory_of_dtensor_shards_is_the_models(foreach: bool) -> None:
    assert run_world(4, optimizer_bytes_measured, foreach, timeout=120) == [[]] * 4


def hpz_gather_bytes_measured(rank: int, world: int, arg: None) -> list[str]:
    """A unit resharded to pairs of ranks after forward (``reshard_after_forward=2`` on 4 ranks):
    the part kept, the next all-gather from it, and a full reshard of a kept part, measured with
    ``LiveBytes`` against ``GatherWalk`` (``per_param_gather_bytes(..., post_forward_ranks=2)``)."""
    from fsdp_core.memory import GatherWalk, per_param_gather_bytes
    from fsdp_core.unshard.schedule import AwaitGather, Gather, Reshard
    from fsdp_shell.fsdp2.state import lazy_init
    from fsdp_shell.memory import LiveBytes

    torch.manual_seed(0)
    model = Odd()
    fully_shard(model, reshard_after_forward=2, shard_placement_fn=lambda p: Shard(1) if p.shape == (4, 8) else None)
    state = state_of(model)
    assert state is not None and state.group is not None
    group = state.group
    runtime = lazy_init(state).runtime(state.mesh)
    small = state.post_forward_runtime
    assert small is not None
    walk = GatherWalk([per_param_gather_bytes(group.layout, group.dtypes.compute, post_forward_ranks=2)])

    def resharded() -> tuple[int, int]:
        start = walk.live
        walk.resharded(0)
        return 0, walk.live - start

    steps: list[tuple[str, Callable[[], None], Callable[[], tuple[int, int]]]] = [
        ("await", lambda: group.unshard(runtime), lambda: walk.run_all([AwaitGather(unit=0)])),
        ("keep a part", lambda: group.reshard_post_forward(small, 2), lambda: walk.run_all([Reshard(unit=0)])),
        ("gather from it", lambda: group.start_unshard(runtime), lambda: walk.run_all([Gather(unit=0)])),
        ("await", lambda: group.unshard(runtime), lambda: walk.run_all([AwaitGather(unit=0)])),
        ("keep a part", lambda: group.reshard_post_forward(small, 2), lambda: walk.run_all([Reshard(unit=0)])),
        ("free it all", group.free_unsharded, resharded),
    ]
    problems = []
    with LiveBytes() as live:
        group.unshard(runtime)  # a first cycle: the mode counts a storage from the first op that touches it
        group.free_unsharded()
        for name, run, model_it in steps:
            with live.window() as w:
                run()
            measured, modeled = (w.peak - w.start, w.end - w.start), model_it()
            if measured != modeled:
                problems.append(f"{name}: measured (peak, net) {measured}, modeled {modeled}")
    return problems


def test_the_gather_memory_model_knows_a_reshard_to_a_smaller_group() -> None:
    assert run_world(4, hpz_gather_bytes_measured, None, timeout=120) == [[]] * 4
