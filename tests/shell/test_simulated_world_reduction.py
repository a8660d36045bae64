"""Communication hooks and division policies, over a simulated world: every hook and every policy
still hands each rank its shard of the sum divided by the world size (or the user's factor),
and a hybrid strategy's replicate all-reduce still follows the hook.

Expected values come from ``simulated_world_cases``: plain torch, in float64, from the gradients
handed to the ranks, with offsets, shard sizes and FSDP1's pre-divide factors written out by
hand; nothing expected is computed by the planner, the layout or the division code under test.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from fsdp_core import CommHook, Divide, Division, DivisionPolicy, Group, MixedPrecision, ReduceKind
from tests.shell.simulated_world_cases import (
    BF16,
    BIG,
    F16,
    F32,
    GLOO,
    HYBRID,
    NCCL,
    ONE_OF_EACH,
    SEVEN,
    SS,
    Mesh,
    assert_averaged,
    make_grads,
    mean_over_world,
    request_for,
    run,
)

# -- communication hooks -----------------------------------------------------------------------


HOOK_PRECISION = {
    CommHook.ALLREDUCE: F32,
    CommHook.REDUCE_SCATTER: F32,
    CommHook.USER: F32,
    CommHook.FP16_COMPRESS: F16,
    CommHook.BF16_COMPRESS: BF16,
}
HOOK_MESHES = [
    Mesh(SS.NO_SHARD, 1),
    Mesh(SS.NO_SHARD, 3),
    Mesh(SS.NO_SHARD, 4),
    Mesh(SS.FULL_SHARD, 3),
    Mesh(SS.FULL_SHARD, 8),
    Mesh(SS.SHARD_GRAD_OP, 4),
    Mesh(SS.HYBRID_SHARD, 2, 3),
    Mesh(SS.HYBRID_SHARD, 1, 3),
    Mesh(SS.HYBRID_SHARD_ZERO2, 4, 2),
]


@pytest.mark.parametrize(
    ("mesh", "hook"),
    [
        pytest.param(mesh, hook, id=f"{mesh}-{hook.value}")
        for mesh in HOOK_MESHES
        for hook in HOOK_PRECISION
        if mesh.sharded or hook is not CommHook.REDUCE_SCATTER
    ],
)
def test_comm_hooks_average_and_the_replicate_all_reduce_still_follows(mesh: Mesh, hook: CommHook) -> None:
    grads = make_grads(mesh.world, BIG.total, F32, seed=20)
    result = run(request_for(mesh, BIG, comm_hook=hook), grads)
    assert_averaged(result, mesh, mean_over_world(grads), precision=HOOK_PRECISION[hook])
    wire = {CommHook.FP16_COMPRESS: F16, CommHook.BF16_COMPRESS: BF16}.get(hook, F32)
    for g, r in enumerate(result.ranks):
        first = g - g % mesh.shard
        (call,) = r.hook_calls
        assert call.hook is hook and call.members == tuple(range(first, first + mesh.shard))
        assert call.pre * call.post == mesh.shard
        assert [(i.kind, i.group, i.dtype) for i in r.issued] == [("comm_hook", Group.SHARD, wire)] + (
            [("all_reduce", Group.REPLICATE, F32)] if mesh.strategy in HYBRID else []
        )


@pytest.mark.parametrize("hook", [CommHook.FP16_COMPRESS, CommHook.BF16_COMPRESS, CommHook.USER], ids=lambda h: h.value)
@pytest.mark.parametrize("mesh", [Mesh(SS.NO_SHARD, 4), Mesh(SS.FULL_SHARD, 3), Mesh(SS.HYBRID_SHARD, 2, 2)], ids=str)
def test_comm_hooks_under_bf16_compute(mesh: Mesh, hook: CommHook) -> None:
    grads = make_grads(mesh.world, SEVEN.total, BF16, seed=21)
    result = run(request_for(mesh, comm_hook=hook, mixed_precision=MixedPrecision(param_dtype=BF16)), grads)
    assert_averaged(result, mesh, mean_over_world(grads), precision=BF16)


# -- division policies -------------------------------------------------------------------------


@dataclass(frozen=True)
class DivisionCase:
    name: str
    division: Division
    mp: MixedPrecision = MixedPrecision()
    precision: torch.dtype = F32

    def __str__(self) -> str:
        return self.name


DIVISION_CASES = [
    DivisionCase("nccl", Division(policy=DivisionPolicy.IN_COLLECTIVE, backend=NCCL)),
    DivisionCase("gloo", Division(policy=DivisionPolicy.IN_COLLECTIVE, backend=GLOO)),
    DivisionCase("nccl-factor-5", Division(policy=DivisionPolicy.IN_COLLECTIVE, backend=NCCL, factor=5.0)),
    DivisionCase("gloo-factor-5", Division(policy=DivisionPolicy.IN_COLLECTIVE, backend=GLOO, factor=5.0)),
    DivisionCase("pre-post-factor-6", Division(factor=6.0)),
    DivisionCase("pre-post-factor-2.5", Division(factor=2.5)),
    DivisionCase("pre-post-factor-0.5", Division(factor=0.5)),
    DivisionCase(
        "nccl-fp16", Division(policy=DivisionPolicy.IN_COLLECTIVE, backend=NCCL), MixedPrecision(param_dtype=F16), F16
    ),
    DivisionCase(
        "nccl-bf16", Division(policy=DivisionPolicy.IN_COLLECTIVE, backend=NCCL), MixedPrecision(param_dtype=BF16), BF16
    ),
    DivisionCase(
        "nccl-bf16-factor-3",
        Division(policy=DivisionPolicy.IN_COLLECTIVE, backend=NCCL, factor=3.0),
        MixedPrecision(reduce_dtype=BF16),
        BF16,
    ),
    DivisionCase(
        "gloo-fp16-factor-3",
        Division(policy=DivisionPolicy.IN_COLLECTIVE, backend=GLOO, factor=3.0),
        MixedPrecision(reduce_dtype=F16),
        F16,
    ),
]


@pytest.mark.parametrize("case", DIVISION_CASES, ids=str)
@pytest.mark.parametrize("mesh", [*ONE_OF_EACH, Mesh(SS.FULL_SHARD, 1), Mesh(SS.HYBRID_SHARD, 4, 2)], ids=str)
def test_division_policies_divide_the_sum_by_the_world_or_the_factor(mesh: Mesh, case: DivisionCase) -> None:
    compute = case.mp.param_dtype or F32
    grads = make_grads(mesh.world, BIG.total, compute, seed=22)
    result = run(request_for(mesh, BIG, division=case.division, mixed_precision=case.mp), grads)
    assert_averaged(result, mesh, mean_over_world(grads, case.division.factor), precision=case.precision)


def test_in_collective_division_on_nccl_averages_inside_the_collectives() -> None:
    mesh = Mesh(SS.HYBRID_SHARD, 2, 2)
    grads = make_grads(mesh.world, SEVEN.total, F32, seed=23)
    result = run(request_for(mesh, division=Division(policy=DivisionPolicy.IN_COLLECTIVE, backend=NCCL)), grads)
    r = result.ranks[0]
    assert not any(isinstance(op, Divide) for op in r.plan.ops)
    assert [(i.kind, i.reduce_op and i.reduce_op.kind) for i in r.issued] == [
        ("reduce_scatter", ReduceKind.AVG),
        ("all_reduce", ReduceKind.AVG),
    ]
