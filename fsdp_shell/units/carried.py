"""The gradient a unit carries between backwards, and the ``.grad`` handshake with the user.

``CarriedGrads`` is one frozen value per unit: every gradient tensor a backward leaves for the
next (the reduced shard, a ``no_sync`` accumulation, a hybrid partial reduction) by the
``InputRole`` the next plan takes it in. Three verbs change it, on the flat parameter
(``FlatParamHandle``) and on the value alike: the user's ``.grad`` is taken back before a unit's
backward (``reclaim``), a plan hands its gradient off (``hand_off``), and the visible gradient is
shown in ``.grad`` (``expose``); ``set_grad`` sets ``.grad`` whatever its shape or dtype.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import torch

from fsdp_core import InputRole, Plan

__all__ = ["CarriedGrads", "set_grad"]


@dataclass(frozen=True, slots=True)
class CarriedGrads:
    """The gradient state one unit carries from one backward into the next, by the input role
    the next plan takes it in: the reduced shard the optimizer sees (``SHARDED_GRAD``), the
    unsharded accumulation of ``no_sync`` backwards (``PENDING_UNSHARDED``), the hybrid partial
    reduction whose replicate all-reduce was deferred (``PENDING_PARTIAL``).

    ``visible`` is the role the user's ``.grad`` shows. Where that ``.grad`` is the tensor
    itself (the flat parameter's, without ``use_orig_params``), the tensor is not held here
    but taken back from ``.grad`` at the next backward, so ``zero_grad()`` frees it as in FSDP1.

    Three transitions change it, the same three verbs as on ``FlatParamHandle``: the user's
    ``.grad`` is taken back (``reclaimed_from_flat``, ``reclaimed_from_views``), a plan hands off
    its gradient (``handed_off``: plans say what they consume and what they leave,
    ``Plan.consumed`` and ``Plan.carried_out``, so no state is inferred from tensor sizes), and
    the visible gradient is shown in ``.grad`` (``exposed``).
    """

    tensors: Mapping[InputRole, torch.Tensor] = field(default_factory=lambda: MappingProxyType({}))
    visible: InputRole | None = None

    @property
    def roles(self) -> frozenset[InputRole]:
        """The roles carried, held here or in the user's ``.grad``."""
        held = frozenset(self.tensors)
        return held if self.visible is None else held | {self.visible}

    def take(self, role: InputRole) -> torch.Tensor:
        """The tensor carried under ``role``; a plan asking for one that is not held is a bug."""
        try:
            return self.tensors[role]
        except KeyError:
            raise RuntimeError(f"the plan takes a carried {role.value} gradient this unit does not hold") from None

    def without(self, role: InputRole) -> CarriedGrads:
        """The state once a plan has taken the tensor carried under ``role``."""
        rest = {r: t for r, t in self.tensors.items() if r is not role}
        return CarriedGrads(MappingProxyType(rest), None if self.visible is role else self.visible)

    def handed_off(self, plan: Plan, handed: torch.Tensor) -> CarriedGrads:
        """The state once ``plan`` has consumed its carried inputs and handed ``handed`` off."""
        kept = {role: t for role, t in self.tensors.items() if role not in plan.consumed}
        out = plan.carried_out
        if out is not None:
            kept[out] = handed
        return CarriedGrads(MappingProxyType(kept), _visible_role(kept))

    def exposed(self) -> tuple[CarriedGrads, torch.Tensor | None]:
        """Hand the visible tensor to the user's ``.grad``: the state without it, and it."""
        if self.visible is None or self.visible not in self.tensors:
            return self, None
        shown = self.tensors[self.visible]
        rest = {role: t for role, t in self.tensors.items() if role is not self.visible}
        return CarriedGrads(MappingProxyType(rest), self.visible), shown

    def reclaimed_from_flat(self, seen: torch.Tensor | None, shard_numel: int) -> CarriedGrads:
        """Take the visible tensor back from the flat parameter's ``.grad`` (``seen``). None
        after it was shown means ``zero_grad(set_to_none=True)``: everything carried is dropped.
        A ``.grad`` the user assigned while none was shown is carried as the reduced shard."""
        if self.visible is not None and self.visible not in self.tensors:
            if seen is None:
                return CarriedGrads()
            return CarriedGrads(MappingProxyType({**self.tensors, self.visible: seen.data.view(-1)}), self.visible)
        if seen is None:
            return self
        if seen.numel() != shard_numel:
            raise RuntimeError(
                f"flat parameter .grad: expected {shard_numel} elements (this rank's shard), got "
                f"{seen.numel()}; assign gradients of the sharded parameter"
            )
        held = {**self.tensors, InputRole.SHARDED_GRAD: seen.data.view(-1)}
        return CarriedGrads(MappingProxyType(held), _visible_role(held))

    def reclaimed_from_views(self, all_dropped: bool) -> CarriedGrads:
        """With ``use_orig_params`` the user sees views of the visible tensor: once they have set
        every one to None (``all_dropped``), nothing is carried; else the same state."""
        return CarriedGrads() if all_dropped and self.visible is not None else self


def _visible_role(held: Mapping[InputRole, torch.Tensor]) -> InputRole | None:
    """What ``.grad`` shows between backwards: the ``no_sync`` accumulation while there is one
    (as in FSDP1), else the reduced shard; a partial reduction is never shown."""
    for role in (InputRole.PENDING_UNSHARDED, InputRole.SHARDED_GRAD):
        if role in held:
            return role
    return None


def set_grad(param: torch.Tensor, grad: torch.Tensor | None) -> None:
    """``param.grad = grad``, also when their shape or dtype differ (unsharded views of a
    sharded parameter, low-precision gradients), as FSDP1 does through ``.data``."""
    if grad is None:
        param.grad = None
        return
    if grad.shape == param.shape and grad.dtype == param.dtype and grad.device == param.device:
        param.grad = grad
        return
    param.grad = torch.empty_like(param)
    assert param.grad is not None
    param.grad.data = grad
