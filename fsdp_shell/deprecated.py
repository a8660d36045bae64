"""FSDP1's deprecated optimizer-state helpers, refused at the call by an error naming the
replacement (FSDP1 itself deprecated them for ``FSDP.optim_state_dict`` and
``FSDP.optim_state_dict_to_load``). The wrapper inherits them from ``DeprecatedOptimStateHelpers``
so that its own module keeps to what works."""

from __future__ import annotations

from typing import Any

__all__ = ["DeprecatedOptimStateHelpers"]


class DeprecatedOptimStateHelpers:
    """The refused static methods of FSDP1's class (``NotImplementedError`` naming what to use)."""

    @staticmethod
    def full_optim_state_dict(*args: object, **kwargs: object) -> dict[str, Any]:
        """Refused: use ``FSDP.optim_state_dict`` (FSDP1 deprecated this one for it)."""
        raise _replaced_by(
            "full_optim_state_dict", "FSDP.optim_state_dict(model, optim) (a full state dict by default)"
        )

    @staticmethod
    def sharded_optim_state_dict(*args: object, **kwargs: object) -> dict[str, Any]:
        """Refused: use ``FSDP.optim_state_dict`` inside ``SHARDED_STATE_DICT``."""
        raise _replaced_by(
            "sharded_optim_state_dict",
            "FSDP.optim_state_dict(model, optim) inside FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT)",
        )

    @staticmethod
    def shard_full_optim_state_dict(*args: object, **kwargs: object) -> dict[str, Any]:
        """Refused: use ``FSDP.optim_state_dict_to_load``."""
        raise _replaced_by("shard_full_optim_state_dict", "FSDP.optim_state_dict_to_load(model, optim, osd)")

    @staticmethod
    def flatten_sharded_optim_state_dict(*args: object, **kwargs: object) -> dict[str, Any]:
        """Refused: use ``FSDP.optim_state_dict_to_load``."""
        raise _replaced_by("flatten_sharded_optim_state_dict", "FSDP.optim_state_dict_to_load(model, optim, osd)")

    @staticmethod
    def scatter_full_optim_state_dict(*args: object, **kwargs: object) -> dict[str, Any]:
        """Refused: use ``FSDP.optim_state_dict_to_load`` on every rank (or
        ``set_state_dict`` with ``broadcast_from_rank0``)."""
        raise _replaced_by(
            "scatter_full_optim_state_dict",
            "FSDP.optim_state_dict_to_load(model, optim, osd) on every rank, or torch.distributed.checkpoint."
            "state_dict.set_state_dict(..., options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))",
        )

    @staticmethod
    def rekey_optim_state_dict(*args: object, **kwargs: object) -> dict[str, Any]:
        """Refused: ``FSDP.optim_state_dict`` is keyed by parameter name already."""
        raise _replaced_by(
            "rekey_optim_state_dict",
            "FSDP.optim_state_dict(model, optim), which is keyed by parameter name already, and "
            "FSDP.optim_state_dict_to_load for the optimizer's own numbering",
        )


def _replaced_by(name: str, replacement: str) -> NotImplementedError:
    return NotImplementedError(f"FSDP.{name}: FSDP1 deprecated it and it is not offered here; use {replacement}")
