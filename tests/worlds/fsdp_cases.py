"""Training cases run inside a gloo world: fsdp_shell vs. a single-process reference vs. FSDP1.

Each case trains the same small nested model for a few optimizer steps. The reference is a
plain ``nn.Module`` in the same process trained on the concatenation of every rank's batch
(the mean loss over the global batch), so it is computed without any of the code under test.
Where PyTorch's FSDP1 supports the configuration, it trains in the same world with the same
arguments. After every step every parameter is compared.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms._comm_hooks import default_hooks
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FullStateDictConfig, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
from torch.distributed.fsdp import MixedPrecision as TorchMixedPrecision
from torch.distributed.fsdp import ShardingStrategy as TorchStrategy
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from fsdp_core import CPUOffload, Group, MixedPrecision, ShardingStrategy
from fsdp_shell import FSDP, comm_hooks
from fsdp_shell.runtime.collectives import CollectiveRecord

BATCH = 3
"""Rows of each rank's micro-batch."""


class Block(nn.Module):
    """A unit of its own under the wrap policy: uneven parameter counts force padding."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.lin = nn.Linear(d_in, d_out)
        self.norm = nn.LayerNorm(d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.norm(self.lin(x)))


class Net(nn.Module):
    """Root-owned embedding-like layer, two wrapped blocks, an unused block, a head."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 5)
        self.blocks = nn.Sequential(Block(5, 7), Block(7, 3))
        self.spare = Block(3, 3)
        self.head = nn.Linear(3, 1)
        self.register_buffer("scale", torch.tensor([1.5]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.scale
        assert isinstance(scale, torch.Tensor)
        out: torch.Tensor = self.head(self.blocks(self.inp(x))) * scale
        return out


@dataclass(frozen=True)
class Case:
    """One training configuration."""

    name: str
    strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD
    use_orig_params: bool = False
    mp: str | None = None
    offload: bool = False
    hook: str | None = None
    no_sync: int = 0
    accumulate: int = 1
    clip: float | None = None
    fsdp1: bool = True
    hybrid: str = "mesh"
    defer_all_reduce: bool = False
    steps: int = 3
    division: str = "pre_post"
    hybrid_all_reduce: str = "async"
    divide_factor: float | None = None
    """Divide the summed gradient by this many ranks' worth (FSDP2's set_gradient_divide_factor)."""
    backward_prefetch: str | None = "BACKWARD_PRE"
    forward_prefetch: bool = False
    device: str = "cpu"
    """Where the models and batches live: ``cpu``, or ``cuda`` (every rank on device 0, for
    ``scripts/gpu_check.sh``)."""


@dataclass
class Outcome:
    """What a case measured on one rank."""

    ref_diff: float = 0.0
    fsdp1_diff: float | None = None
    hook_calls: int = 0
    collectives_in_no_sync: int = 0
    reduce_dtypes: list[str] = field(default_factory=list)
    spare_grads_none: bool = True
    norm_diff: float = 0.0
    state_dict_diff: float = 0.0
    param_shapes: list[tuple[int, ...]] = field(default_factory=list)
    ref_shapes: list[tuple[int, ...]] = field(default_factory=list)


def _data(step: int, micro: int, world: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + micro)
    x, y = torch.randn(world * BATCH, 6, generator=g), torch.randn(world * BATCH, 1, generator=g)
    return x.to(device), y.to(device)


def _mp(case: Case) -> tuple[MixedPrecision | None, TorchMixedPrecision | None]:
    if case.mp == "bf16":
        return MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32), TorchMixedPrecision(
            param_dtype=torch.bfloat16, reduce_dtype=torch.float32
        )
    if case.mp == "bf16-reduce":
        return MixedPrecision(reduce_dtype=torch.bfloat16), TorchMixedPrecision(reduce_dtype=torch.bfloat16)
    return None, None


def _groups(case: Case, world: int) -> tuple[tuple[dist.ProcessGroup, dist.ProcessGroup] | None, DeviceMesh | None]:
    """(process_group, device_mesh) for the case: hybrid as a 2-D mesh or a (shard, replicate) pair."""
    if case.hybrid == "mesh1d":
        return None, init_device_mesh(case.device, (world,), mesh_dim_names=("shard",))
    if not case.strategy.is_hybrid:
        return None, None
    mesh = init_device_mesh(case.device, (world // 2, 2), mesh_dim_names=("replicate", "shard"))
    if case.hybrid == "mesh":
        return None, mesh
    return (mesh.get_group(1), mesh.get_group(0)), None


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b), (sorted(a), sorted(b))
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def _torch_full(model: TorchFSDP) -> dict[str, torch.Tensor]:
    cfg = FullStateDictConfig(offload_to_cpu=False, rank0_only=False)
    with TorchFSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
        return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _step_model(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    case: Case,
    step: int,
    world: int,
    rank: int,
    no_sync: Callable[[], contextlib.AbstractContextManager[None]] | None,
    before_last: Callable[[], None] = lambda: None,
    loss_scale: float = 1.0,
) -> None:
    micro = case.no_sync + case.accumulate
    for m in range(micro):
        x, y = _data(step, m, world, case.device)
        if rank >= 0:
            x, y = x[rank * BATCH : (rank + 1) * BATCH], y[rank * BATCH : (rank + 1) * BATCH]
        in_no_sync = m < case.no_sync and no_sync is not None
        if m == micro - 1:
            before_last()
        with no_sync() if (in_no_sync and no_sync is not None) else contextlib.nullcontext():
            loss = ((model(x) - y) ** 2).mean() * loss_scale
            loss.backward()


def run_case(rank: int, world: int, case: Case) -> Outcome:
    """Train ``case`` here and measure it against the reference and FSDP1."""
    outcome = Outcome()
    torch.manual_seed(0)
    ref = Net().to(case.device)
    init = {k: v.clone() for k, v in ref.state_dict().items()}
    ours_module = Net().to(case.device)
    ours_module.load_state_dict(init)
    mp, torch_mp = _mp(case)
    pg, mesh = _groups(case, world)
    model = FSDP(
        ours_module,
        process_group=pg,
        device_mesh=mesh,
        sharding_strategy=case.strategy,
        auto_wrap_policy={Block},
        mixed_precision=mp,
        cpu_offload=CPUOffload(offload_params=case.offload),
        use_orig_params=case.use_orig_params,
        division_policy=case.division,
        hybrid_all_reduce=case.hybrid_all_reduce,
        backward_prefetch=case.backward_prefetch,
        forward_prefetch=case.forward_prefetch,
        device_id=None if case.device == "cpu" else torch.device(case.device, 0),
    )
    ref_scale = 1.0
    if case.divide_factor is not None:
        model.set_gradient_divide_factor(case.divide_factor)
        ref_scale = world / case.divide_factor
    if case.hook is not None:
        calls = [0]
        hook, state = _hook(case, model)

        def counted(state: object, grad: torch.Tensor, output: torch.Tensor | None = None) -> None:
            calls[0] += 1
            if output is None:
                hook(state, grad)
            else:
                hook(state, grad, output)

        counted.__name__ = getattr(hook, "__name__", "hook")
        counted.__module__ = getattr(hook, "__module__", __name__)
        model.register_comm_hook(state, counted)
    theirs: TorchFSDP | None = None
    if case.fsdp1:
        torch_module = Net()
        torch_module.load_state_dict(init)
        theirs = TorchFSDP(
            torch_module,
            sharding_strategy=_torch_strategy(case.strategy),
            auto_wrap_policy=functools.partial(_torch_policy),
            mixed_precision=torch_mp,
            use_orig_params=case.use_orig_params,
            device_id=torch.device("cpu"),
            process_group=pg,
            device_mesh=mesh,
        )
    outcome.param_shapes = sorted(tuple(p.shape) for p in model.parameters())
    outcome.ref_shapes = sorted(tuple(p.shape) for p in ref.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    topt = torch.optim.SGD(theirs.parameters(), lr=0.05, momentum=0.9) if theirs is not None else None
    with model.watch_collectives() as collectives:  # every collective of the case's training

        def ours_no_sync() -> contextlib.AbstractContextManager[None]:
            return _counting(model.no_sync(), collectives, outcome)

        def before_last() -> None:
            if case.defer_all_reduce:
                model.set_requires_all_reduce(True)

        for step in range(case.steps):
            if case.defer_all_reduce:
                model.set_requires_all_reduce(False)
            _step_model(model, opt, case, step, world, rank, ours_no_sync, before_last)
            _step_model(ref, ropt, case, step, world, -1, None, loss_scale=ref_scale)
            if theirs is not None and topt is not None:
                _step_model(theirs, topt, case, step, world, rank, theirs.no_sync)
            if case.clip is not None:
                ours_norm = model.clip_grad_norm_(case.clip)
                ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), case.clip)
                outcome.norm_diff = max(outcome.norm_diff, float((ours_norm - ref_norm).abs()))
                if theirs is not None:
                    theirs.clip_grad_norm_(case.clip)
            outcome.spare_grads_none &= all(p.grad is None for n, p in model.named_parameters() if "spare" in n)
            for o in (opt, ropt, topt):
                if o is not None:
                    o.step()
                    o.zero_grad()
            full = model.full_state_dict()
            outcome.ref_diff = max(outcome.ref_diff, _max_diff(full, ref.state_dict()))
            if theirs is not None:
                d = _max_diff(full, _torch_full(theirs))
                outcome.fsdp1_diff = d if outcome.fsdp1_diff is None else max(outcome.fsdp1_diff, d)
    outcome.reduce_dtypes = sorted(
        {str(r.dtype) for r in collectives if r.group is Group.SHARD and r.op != "all_gather"}
    )
    if case.hook is not None:
        outcome.hook_calls = calls[0]
    outcome.state_dict_diff = _round_trip(model, rank)
    return outcome


def _round_trip(model: FSDP, rank: int) -> float:
    full = model.full_state_dict()
    changed = {k: v + 1.0 for k, v in full.items()}
    model.load_full_state_dict(changed)
    back = model.full_state_dict()
    model.load_full_state_dict(full)
    return _max_diff(back, changed)


def _torch_strategy(strategy: ShardingStrategy) -> TorchStrategy:
    name = "_HYBRID_SHARD_ZERO2" if strategy is ShardingStrategy.HYBRID_SHARD_ZERO2 else strategy.name
    return TorchStrategy[name]


def _torch_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
    return recurse or isinstance(module, Block)


@contextlib.contextmanager
def _counting(
    cm: contextlib.AbstractContextManager[None], log: list[CollectiveRecord], outcome: Outcome
) -> Iterator[None]:
    before = len(log)
    with cm:
        yield
    outcome.collectives_in_no_sync += sum(r.op != "all_gather" for r in log[before:])


def _hook(case: Case, model: FSDP) -> tuple[Callable[..., None], object]:
    group = model.process_group
    if case.hook == "torch-default":
        state = default_hooks.DefaultState(group)
        fn = default_hooks.allreduce_hook if not case.strategy.is_sharded else default_hooks.reduce_scatter_hook
        return fn, state
    ours = {
        "allreduce": comm_hooks.allreduce_hook,
        "reduce_scatter": comm_hooks.reduce_scatter_hook,
        "fp16": comm_hooks.fp16_compress_hook,
        "bf16": comm_hooks.bf16_compress_hook,
    }[str(case.hook)]
    return ours, comm_hooks.DefaultState(group)


FP32_TOL = 1e-5
BF16_TOL = 5e-2


def check_outcomes(case: Case, outcomes: list[Outcome]) -> None:
    """Assert what ``case`` promises on every rank: the reference's (and FSDP1's) numbers, no
    gradient for the unused unit, an exact state-dict round trip, no reduction inside
    ``no_sync``, the hook called, the clipped norm, the reduce dtype."""
    tol = BF16_TOL if case.mp is not None or case.hook in ("fp16", "bf16") else FP32_TOL
    for rank, o in enumerate(outcomes):
        assert o.ref_diff < tol, f"{case.name} rank {rank}: differs from the reference by {o.ref_diff}"
        if case.fsdp1:
            assert o.fsdp1_diff is not None and o.fsdp1_diff < tol, f"{case.name} rank {rank}: vs FSDP1 {o.fsdp1_diff}"
        assert o.spare_grads_none, f"{case.name}: the unused unit got a gradient"
        assert o.state_dict_diff == 0.0
        if case.no_sync:
            assert o.collectives_in_no_sync == 0, f"{case.name}: {o.collectives_in_no_sync} reductions inside no_sync"
        if case.hook is not None:
            assert o.hook_calls > 0, f"{case.name}: the hook was never called"
        if case.clip is not None:
            assert o.norm_diff < tol
        if case.mp == "bf16-reduce":
            assert o.reduce_dtypes == ["torch.bfloat16"]
        elif case.mp == "bf16":
            assert o.reduce_dtypes == ["torch.float32"]


def run_cases(rank: int, world: int, cases: tuple[Case, ...]) -> dict[str, Outcome]:
    """Every case in turn in this world (one world start for many cases)."""
    return {case.name: run_case(rank, world, case) for case in cases}


class TiedHead(nn.Module):
    """An input layer whose weight the output layer shares, around two units."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 16)
        self.mid = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
        self.out = nn.Linear(16, 16)
        self.out.weight = self.inp.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.out(self.mid(self.inp(x)))
        return out


def bf16_reduction_losses(rank: int, world: int, arg: None) -> dict[str, list[float]]:
    """Ten AdamW steps of ``TiedHead`` in bf16 with bf16 reduction over one shard group of
    ``world`` ranks: FSDP1's losses, ours, and ours with gloo's reduce-scatter done as FSDP1's
    is on gloo (an all-reduce, ``fsdp_core.execution.lane.ALL_TO_ALL_MAX_BYTES`` below every size)
    instead of an all-to-all whose chunks are summed in rank order."""
    import fsdp_core.execution.lane as gloo_forms

    def losses(make: Callable[[nn.Module], nn.Module]) -> list[float]:
        torch.manual_seed(0)
        model = make(TiedHead())
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        out = []
        for step in range(10):
            g = torch.Generator().manual_seed(100 * step + rank)
            x, y = torch.randn(8, 16, generator=g), torch.randn(8, 16, generator=g)
            loss = (model(x).float() - y).square().sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            total = loss.detach().clone()
            dist.all_reduce(total)
            out.append(float(total) / world)
        return out

    bf16 = torch.bfloat16
    theirs = losses(
        lambda m: TorchFSDP(
            m,
            auto_wrap_policy=ModuleWrapPolicy({nn.Sequential}),
            mixed_precision=TorchMixedPrecision(param_dtype=bf16, reduce_dtype=bf16),
            device_id=torch.device("cpu"),
        )
    )
    ours = losses(lambda m: FSDP(m, auto_wrap_policy={nn.Sequential}, mixed_precision=MixedPrecision(param_dtype=bf16)))
    all_to_all = gloo_forms.ALL_TO_ALL_MAX_BYTES
    gloo_forms.ALL_TO_ALL_MAX_BYTES = -1
    try:
        ours_all_reduce = losses(
            lambda m: FSDP(m, auto_wrap_policy={nn.Sequential}, mixed_precision=MixedPrecision(param_dtype=bf16))
        )
    finally:
        gloo_forms.ALL_TO_ALL_MAX_BYTES = all_to_all
    return {"fsdp1": theirs, "ours": ours, "ours_all_reduce": ours_all_reduce}
