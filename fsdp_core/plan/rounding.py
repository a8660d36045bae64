"""How far rounding can move a gradient on its way through the plans of one step: a bound derived
from the plans' ops, dtypes and group sizes, not a tolerance picked by hand.

Every floating-point operation rounds. In the standard model (Higham, *Accuracy and Stability of
Numerical Algorithms*, 2nd ed., sections 2.1-2.2 and 4.2) ``fl(x op y) = (x op y)(1 + d) + e`` with
``|d| <= u``, the dtype's unit roundoff (half its machine epsilon), and ``|e| <= eta``, half its
smallest subnormal, which only a result that underflows incurs. The gradient a plan hands to the
optimizer is a sum of terms ``x_i``, every rank's autograd gradient of every micro-batch, times
the scale of the divisions ``s``. Following each term through the ops that round it (a cast that
narrows, a division, each addition of an accumulation, ``n - 1`` additions of a collective over
``n`` ranks in any order, the division of ``AVG`` or the multiplication of ``PREMUL_SUM``), the
result is ``sum_i x_i s (1 + t_i) + E`` with ``|1 + t_i| <= prod (1 + u_j)``, the product over the
roundings on the term's path, so ``|t_i| <= exp(rho) - 1`` where ``rho`` is the largest sum of
unit roundoffs over any path, and ``|E| <= exp(rho) alpha`` where ``alpha`` sums the underflow
errors as the later divisions and sums carry them. Hence, elementwise,

    |computed - exact| <= (exp(rho) - 1) * s * sum_i |x_i| + exp(rho) * alpha      (``Rounding.bound``)

where ``exact = s * sum_i x_i``. Widening casts (bf16 or fp16 to fp32), padding, copies and
offloads are exact. A collective is assumed to reduce in its buffers' dtype or wider (gloo and
NCCL do). A user's comm hook is code, not data: its arithmetic is unknown, and so is its bound.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import assert_never

import torch

from fsdp_core.plan.ops import (
    Accumulate,
    AllReduce,
    AllReduceHookCall,
    Cast,
    CommHookCall,
    CopyIn,
    Divide,
    EndOfBackwardWait,
    Free,
    FreeUnshardedParam,
    GradViews,
    HandOff,
    Input,
    InputRole,
    Offload,
    Op,
    Pad,
    RecordStream,
    ReduceScatter,
    WaitStream,
)
from fsdp_core.plan.request import Plan, PlanRequest
from fsdp_core.spec.config import CommHook
from fsdp_core.spec.division import ReduceKind, ReduceOpSpec

__all__ = ["Rounding", "plan_rounding", "step_rounding", "unit_roundoff", "widens_exactly"]


def unit_roundoff(dtype: torch.dtype) -> float:
    """``u``: the largest relative error of rounding to ``dtype`` (half its machine epsilon)."""
    return torch.finfo(dtype).eps / 2


def _underflow(dtype: torch.dtype) -> float:
    """``eta``: the largest absolute error of a result that underflows in ``dtype`` (half its
    smallest subnormal)."""
    info = torch.finfo(dtype)
    return info.smallest_normal * info.eps / 2


def widens_exactly(src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether every value of ``src`` is a value of ``dst`` (a cast that cannot round)."""
    if src == dst:
        return True
    a, b = torch.finfo(src), torch.finfo(dst)
    return b.eps <= a.eps and b.max >= a.max and b.smallest_normal * b.eps <= a.smallest_normal * a.eps


@dataclass(frozen=True, slots=True)
class Rounding:
    """The rounding a value has been through: ``roundoffs`` is ``rho``, the largest sum of unit
    roundoffs over the paths of its terms, and ``underflow`` is ``alpha``, the absolute error its
    underflows can add (module docstring)."""

    roundoffs: float = 0.0
    underflow: float = 0.0

    @property
    def relative(self) -> float:
        """``exp(rho) - 1``: the largest relative perturbation of any one term."""
        return math.expm1(self.roundoffs)

    def bound(self, magnitude: float) -> float:
        """The largest ``|computed - exact|`` of an element whose terms' scaled magnitudes sum to
        ``magnitude`` (``s * sum |x_i|``)."""
        return self.relative * magnitude + math.exp(self.roundoffs) * self.underflow

    def rounded(self, dtype: torch.dtype, times: int = 1) -> Rounding:
        """After ``times`` more roundings in ``dtype`` on every term's path."""
        return Rounding(self.roundoffs + times * unit_roundoff(dtype), self.underflow + times * _underflow(dtype))

    def cast(self, src: torch.dtype, dst: torch.dtype) -> Rounding:
        """After a cast from ``src`` to ``dst`` (exact when it widens)."""
        return self if widens_exactly(src, dst) else self.rounded(dst)

    def divided(self, factor: float, dtype: torch.dtype) -> Rounding:
        """After dividing by ``factor`` in ``dtype`` (exact by 1)."""
        if factor == 1:
            return self
        return Rounding(self.roundoffs + unit_roundoff(dtype), self.underflow / factor + _underflow(dtype))

    def reduced(self, ranks: int, dtype: torch.dtype, op: ReduceOpSpec) -> Rounding:
        """After a collective over ``ranks`` ranks that each hold a value rounded like this one:
        ``ranks - 1`` additions on the longest path, in any order; ``AVG`` then divides by
        ``ranks``, ``PREMUL_SUM`` first multiplies each input."""
        u, eta = unit_roundoff(dtype), _underflow(dtype)
        adds = ranks - 1
        match op.kind:
            case ReduceKind.SUM:
                return Rounding(self.roundoffs + adds * u, ranks * self.underflow + adds * eta)
            case ReduceKind.AVG:
                return Rounding(self.roundoffs + ranks * u, self.underflow + adds * eta / ranks + eta)
            case ReduceKind.PREMUL_SUM:
                scaled = ranks * op.premul * self.underflow
                return Rounding(self.roundoffs + ranks * u, scaled + ranks * eta + adds * eta)
            case _:
                assert_never(op.kind)

    def plus(self, other: Rounding, dtype: torch.dtype) -> Rounding:
        """After adding a value rounded like ``other`` to this one, in ``dtype``."""
        return Rounding(
            max(self.roundoffs, other.roundoffs) + unit_roundoff(dtype),
            self.underflow + other.underflow + _underflow(dtype),
        )


def _hooked(held: Rounding, op: CommHookCall, ranks: int) -> Rounding:
    """A built-in comm hook (``fsdp_shell.comm_hooks``, FSDP1's ``default_hooks``): cast to the
    wire dtype, divide by the state's pre-divide factor, sum over the group, divide by its
    post-divide factor, cast back. Both divisions are counted (each factor is at least 1, so the
    underflow of the first is not grown by the sum more than the sum grows everything)."""
    if op.hook is CommHook.USER or op.hook is CommHook.NONE:
        raise ValueError(
            f"plan: a {op.hook.value} comm hook's arithmetic is not part of the plan, so its rounding "
            "cannot be bounded; accepted: the built-in hooks (allreduce, reduce_scatter, fp16_compress, "
            "bf16_compress)"
        )
    wire = op.wire_dtype
    on_wire = held.cast(op.src.dtype, wire).rounded(wire)
    summed = on_wire.reduced(ranks, wire, ReduceOpSpec())
    return summed.rounded(wire).cast(wire, op.dst.dtype)


def plan_rounding(plan: Plan, carried: Mapping[InputRole, Rounding] | None = None) -> Rounding | None:
    """The rounding of the gradient ``plan`` hands off (None if it hands none off), given the
    rounding of each gradient it takes from earlier backwards (``carried``, by input role; this
    backward's own gradient is exact: the terms are autograd's gradients).

    Raises ``ValueError`` naming ``carried`` when the plan takes a gradient it does not hold, and
    naming ``plan`` for a user comm hook, whose arithmetic is not known."""
    carried = {} if carried is None else carried
    held: dict[str, Rounding] = {}
    handed: Rounding | None = None
    for op in plan.ops:
        handed = _step(op, plan.request, carried, held) or handed
    return handed


def _step(
    op: Op, request: PlanRequest, carried: Mapping[InputRole, Rounding], held: dict[str, Rounding]
) -> Rounding | None:
    """Apply ``op`` to the roundings ``held`` by buffer name; the rounding handed off, if it hands off."""
    match op:
        case Input():
            if op.role is InputRole.GRAD:
                held[op.buffer.name] = Rounding()
            elif op.role in carried:
                held[op.buffer.name] = carried[op.role]
            else:
                raise ValueError(
                    f"carried: the plan takes a {op.role.value} gradient, but only "
                    f"{sorted(r.value for r in carried) or 'none'} is carried"
                )
        case Cast() | CopyIn():
            held[op.dst.name] = held[op.src.name].cast(op.src.dtype, op.dst.dtype)
        case Pad():
            held[op.dst.name] = held[op.src.name]
        case Divide():
            held[op.buffer.name] = held[op.buffer.name].divided(op.factor, op.buffer.dtype)
        case ReduceScatter():
            held[op.dst.name] = held[op.src.name].reduced(request.group_size(op.group), op.src.dtype, op.reduce_op)
        case AllReduce():
            held[op.buffer.name] = held[op.buffer.name].reduced(
                request.group_size(op.group), op.buffer.dtype, op.reduce_op
            )
        case CommHookCall():
            held[op.dst.name] = _hooked(held[op.src.name], op, request.group_size(op.group))
        case Accumulate():
            held[op.dst.name] = held[op.dst.name].plus(held[op.src.name], op.dst.dtype)
        case Offload():
            copied = held[op.src.name].cast(op.src.dtype, op.dst.dtype)
            held[op.dst.name] = held[op.dst.name].plus(copied, op.dst.dtype) if op.accumulate else copied
        case HandOff():
            return held[op.buffer.name]
        case WaitStream() | RecordStream() | Free() | FreeUnshardedParam() | GradViews() | EndOfBackwardWait():
            pass
        case AllReduceHookCall():  # what the user's hook does to the values is its own
            pass
        case _:
            assert_never(op)
    return None


def step_rounding(plans: Iterable[Plan]) -> Rounding:
    """The rounding of the reduced gradient the optimizer steps on after the backwards whose plans
    are ``plans`` (one unit's, in the order they ran, from no carried gradient: the step after
    ``zero_grad``). What each plan hands off is carried into the next under its role
    (``Plan.carried_out``), as the runtime carries the tensors. Raises ``ValueError`` naming
    ``plans`` when no reduced gradient is left for the optimizer (the last backward ran inside
    ``no_sync``, or a hybrid all-reduce is still deferred)."""
    carried: dict[InputRole, Rounding] = {}
    for plan in plans:
        out = plan_rounding(plan, carried)
        carried = {role: r for role, r in carried.items() if role not in plan.consumed}
        if plan.carried_out is not None and out is not None:
            carried[plan.carried_out] = out
    if set(carried) != {InputRole.SHARDED_GRAD}:
        raise ValueError(
            "plans: the optimizer's gradient is not whole after these backwards (carried: "
            f"{sorted(r.value for r in carried) or 'nothing'}); the last backward must synchronise"
        )
    return carried[InputRole.SHARDED_GRAD]
