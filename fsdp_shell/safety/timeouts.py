"""A backend that gives up waiting for the other ranks becomes an error that says where.

Only FSDP's own collective sections are wrapped (the agreement, gathers, reductions, the end of
backward), never the user's module: gloo's ``Timed out waiting ...`` (or a peer that closed its
connection) inside one becomes a ``CollectiveTimeoutError`` naming the rank, the step and the
unit, with the usual causes.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch.distributed as dist

from fsdp_shell.safety.agreement import RankMismatchError

__all__ = ["CollectiveTimeoutError", "gave_up_waiting", "timeout_error"]


class CollectiveTimeoutError(RuntimeError):
    """A collective of FSDP's gave up waiting for the other ranks (the process group's timeout,
    or a peer that closed its connection): a rank stopped or died, or the ranks' models took
    different paths without ``ranks_may_diverge=True``."""


_GAVE_UP = re.compile(r"timed out|connection closed by peer|connection reset by peer|broken pipe", re.IGNORECASE)


def gave_up_waiting(error: BaseException) -> bool:
    """Whether ``error`` is a backend giving up on the other ranks (gloo's timeout or a lost
    peer), rather than a failure of this rank's own work."""
    return (
        isinstance(error, RuntimeError)
        and not isinstance(error, (RankMismatchError, CollectiveTimeoutError))
        and _GAVE_UP.search(str(error)) is not None
    )


def timeout_error(
    error: RuntimeError, step: str, where: Callable[[], str], sequenced: bool, *, causes: str | None = None
) -> CollectiveTimeoutError | None:
    """What to raise for ``error`` in FSDP's own collectives of ``step`` in ``where()`` (the root,
    or a unit; asked only on a timeout): a ``CollectiveTimeoutError`` when the backend gave up
    waiting, None when ``error`` is this rank's own and stays as it is. ``sequenced``: the ranks
    agree on every event (``ranks_may_diverge``), so divergent paths are not the cause;
    ``causes``: the likely causes in the caller's words instead (``fully_shard`` has no
    ``ranks_may_diverge``)."""
    if not gave_up_waiting(error):
        return None
    mode = causes or (
        "even with ranks_may_diverge=True: a rank stopped, died or is still busy"
        if sequenced
        else "a rank stopped, died or is still busy, or the ranks' models took different paths (a wrapped "
        "module skipped, or its output left unused, on some ranks only: pass ranks_may_diverge=True "
        "for models that do that)"
    )
    return CollectiveTimeoutError(
        f"FSDP: rank {dist.get_rank()} gave up waiting for the other ranks in the {step} of {where()}: {mode}. "
        f"Backend: {_first_line(error)}"
    )


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
