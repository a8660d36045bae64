"""Gradient state carried from one backward into the next, named by ``InputRole``.

Between backwards a flat parameter may hold up to three buffers: the reduced sharded gradient
(``SHARDED_GRAD``), the unsharded gradient accumulated inside ``no_sync``
(``PENDING_UNSHARDED``) and the hybrid partial reduction whose all-reduce was deferred
(``PENDING_PARTIAL``). The shell keeps them as one frozen mapping keyed by role; these pure
functions say which role a hand-off is carried under and which ``StepFlags`` a carried set
implies. A plan takes the roles in ``Plan.consumed`` and leaves ``Plan.carried_out``, so the
state after a backward is ``(carried - plan.consumed) | {plan.carried_out}``.
"""

from __future__ import annotations

from typing import assert_never

from fsdp_core.plan.ops import Destination, InputRole
from fsdp_core.spec.config import StepFlags

__all__ = ["CARRIED_ROLES", "carried_role", "step_flags"]

CARRIED_ROLES: frozenset[InputRole] = frozenset(
    {InputRole.SHARDED_GRAD, InputRole.PENDING_UNSHARDED, InputRole.PENDING_PARTIAL}
)
"""The roles a buffer can be carried under: every ``InputRole`` except this backward's ``GRAD``."""


def carried_role(destination: Destination) -> InputRole:
    """The input role under which a gradient handed off at ``destination`` enters the next backward.

    A reduced shard, wherever it was left (``SHARDED_GRAD``, ``ACCUMULATED_GRAD``, ``CPU_GRAD``),
    is the next backward's ``SHARDED_GRAD``; the unsharded ``no_sync`` gradient
    (``UNSHARDED_GRAD``) its ``PENDING_UNSHARDED``; a kept ``PARTIAL`` its ``PENDING_PARTIAL``.
    """
    match destination:
        case Destination.SHARDED_GRAD | Destination.ACCUMULATED_GRAD | Destination.CPU_GRAD:
            return InputRole.SHARDED_GRAD
        case Destination.UNSHARDED_GRAD:
            return InputRole.PENDING_UNSHARDED
        case Destination.PARTIAL:
            return InputRole.PENDING_PARTIAL
        case _:
            assert_never(destination)


def step_flags(
    carried: frozenset[InputRole],
    *,
    sync_gradients: bool,
    requires_all_reduce: bool,
    force_full_precision: bool = False,
) -> StepFlags:
    """The ``StepFlags`` of a backward that starts with the buffers of ``carried``.

    ``accumulate``, ``pending_unsharded`` and ``pending_partial`` say whether ``SHARDED_GRAD``,
    ``PENDING_UNSHARDED`` and ``PENDING_PARTIAL`` are in ``carried``; the other flags are this
    step's choices, passed through, except that inside ``no_sync`` (``sync_gradients`` False)
    nothing is reduced, so no all-reduce is deferred either: ``requires_all_reduce`` is True
    there whatever was asked (one plan request per backward, whatever the hybrid setting).
    Raises ``TypeError`` naming ``carried`` when it is not a frozenset of ``InputRole``, and
    ``ValueError`` when it holds ``InputRole.GRAD`` (this backward's gradient is produced, never
    carried).
    """
    if not isinstance(carried, frozenset) or not all(isinstance(r, InputRole) for r in carried):
        raise TypeError(f"carried: expected a frozenset of InputRole, got {carried!r}")
    if InputRole.GRAD in carried:
        raise ValueError(
            "carried: InputRole.GRAD is the gradient this backward produces and is never carried; "
            f"carried roles are {', '.join(sorted(r.name for r in CARRIED_ROLES))}"
        )
    return StepFlags(
        sync_gradients=sync_gradients,
        accumulate=InputRole.SHARDED_GRAD in carried,
        pending_unsharded=InputRole.PENDING_UNSHARDED in carried,
        requires_all_reduce=requires_all_reduce or not sync_gradients,
        pending_partial=InputRole.PENDING_PARTIAL in carried,
        force_full_precision=force_full_precision,
    )
