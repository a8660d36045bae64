"""The gradient a unit carries between backwards, and the ``.grad`` handshake with the user.

``CarriedGrads`` holds, per unit, every gradient tensor a backward leaves for the next (the
reduced shard, a ``no_sync`` accumulation, a hybrid partial reduction) by the ``InputRole`` the
next plan takes it in. Three verbs change it: the user's ``.grad`` is taken back before a unit's
backward (``reclaim``), a plan hands its gradient off (``hand_off``), and the visible gradient is
shown in ``.grad`` (``expose``); a plan's ``Input`` takes a carried tensor by its role (``take``).
``set_grad`` sets ``.grad`` whatever its shape or dtype.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from fsdp_core import InputRole, Plan
from fsdp_shell.units.grads import Grads

__all__ = ["CarriedGrads", "set_grad"]


class CarriedGrads:
    """The gradient state one unit carries from one backward into the next, by the input role
    the next plan takes it in: the reduced shard the optimizer sees (``SHARDED_GRAD``), the
    unsharded accumulation of ``no_sync`` backwards (``PENDING_UNSHARDED``), the hybrid partial
    reduction whose replicate all-reduce was deferred (``PENDING_PARTIAL``).

    ``visible`` is the role the user's ``.grad`` shows. Without ``use_orig_params`` (no
    ``orig_params``) that ``.grad`` is the flat parameter's and the tensor itself: it is not held
    here but taken back from ``.grad`` at the next backward, so ``zero_grad()`` frees it as in
    FSDP1. With ``use_orig_params`` the user sees views of it in the original parameters'
    ``.grad`` (the plan's ``GradViews``); once they have set every one to None, nothing is
    carried (FSDP1's ``_reset_flat_param_grad_info_if_needed``).

    Plans say what they consume and what they leave (``Plan.consumed``, ``Plan.carried_out``), so
    no state is inferred from tensor sizes.
    """

    def __init__(self, flat_param: nn.Parameter, orig_params: tuple[nn.Parameter, ...], shard_numel: int) -> None:
        self.tensors: dict[InputRole, torch.Tensor] = {}
        """What is held here, by role (the visible tensor only while it is not shown)."""
        self.visible: InputRole | None = None
        self._flat_param = flat_param
        self._orig_params = orig_params
        self._shard_numel = shard_numel

    @property
    def roles(self) -> frozenset[InputRole]:
        """The roles carried, held here or in the user's ``.grad``."""
        held = frozenset(self.tensors)
        return held if self.visible is None else held | {self.visible}

    def reclaim(self, *, at_forward: bool = False) -> None:
        """Take back the gradient the user sees, before this unit's backward: what they did to it
        is reconciled with the carried state (``zero_grad(set_to_none=True)`` drops all of it; a
        partial reduction they never see is kept), and the flat parameter's ``.grad`` is cleared
        so autograd accumulates this backward's gradient afresh. ``at_forward``: only what is
        safe at the root's forward, as FSDP1 does there: with ``use_orig_params`` a gradient the
        user dropped is freed; the flat parameter's ``.grad`` stays the user's.

        Without ``use_orig_params``, None in ``.grad`` after it was shown means everything
        carried is dropped, and a ``.grad`` the user assigned while none was shown is carried as
        the reduced shard."""
        flat = self._flat_param
        if self._orig_params:
            if self.visible is not None and all(p.grad is None for p in self._orig_params):
                self.tensors, self.visible = {}, None
        elif not at_forward:
            seen = flat.grad
            if self.visible is not None and self.visible not in self.tensors:
                if seen is None:
                    self.tensors, self.visible = {}, None
                else:
                    self.tensors[self.visible] = seen.data.view(-1)
            elif seen is not None:
                if seen.numel() != self._shard_numel:
                    raise RuntimeError(
                        f"flat parameter .grad: expected {self._shard_numel} elements (this rank's shard), got "
                        f"{seen.numel()}; assign gradients of the sharded parameter"
                    )
                self.tensors[InputRole.SHARDED_GRAD] = seen.data.view(-1)
                self.visible = _visible_role(self.tensors)
        if not at_forward:
            flat.grad = None

    def take(self, role: InputRole) -> torch.Tensor:
        """The carried tensor a plan takes under ``role``, no longer held here: the plan's run
        holds it alone from now on, so it is freed at the plan's ``Free`` of it. With
        ``use_orig_params`` the original parameters' ``.grad`` views of it go too (the plan's
        ``GradViews`` shows the new gradient): they kept a ``no_sync`` accumulation alive to the
        end of backward, one unsharded gradient per unit. A plan asking for a role that is not
        held is a bug."""
        t = self.tensors.pop(role, None)
        if t is None:
            raise RuntimeError(f"the plan takes a carried {role.value} gradient this unit does not hold")
        if self.visible is role:
            self.visible = None
            for orig in self._orig_params:
                orig.grad = None
        return t

    def hand_off(self, plan: Plan, value: Grads) -> None:
        """Take what ``plan`` hands off: its carried inputs consumed, ``grad`` carried under
        ``plan.carried_out``; then shown (``expose``)."""
        grad = value
        assert isinstance(grad, torch.Tensor), "a flat parameter's plans bind one tensor to each buffer"
        kept = {role: t for role, t in self.tensors.items() if role not in plan.consumed}
        if plan.carried_out is not None:
            kept[plan.carried_out] = grad
        self.tensors, self.visible = kept, _visible_role(kept)
        self.expose()

    def expose(self) -> None:
        """Without ``use_orig_params``: the gradient the optimizer should see becomes the flat
        parameter's ``.grad``, held only there (also after a backward in which this unit got
        none: then ``.grad`` is put back as it was)."""
        if self._orig_params or self.visible is None:
            return
        shown = self.tensors.pop(self.visible, None)
        if shown is not None:
            set_grad(self._flat_param, shown)


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
