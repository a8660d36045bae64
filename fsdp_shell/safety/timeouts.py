"""A backend that gives up waiting for the other ranks becomes an error that says where.

Only FSDP's own collective sections are wrapped (the agreement, gathers, reductions, the end of
backward), never the user's module: gloo's ``Timed out waiting ...`` (or a peer that closed its
connection) inside one becomes a ``CollectiveTimeoutError`` naming the rank, the step and the
unit, with the usual causes.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterator

import torch.distributed as dist

from fsdp_shell.safety.agreement import RankMismatchError

__all__ = ["CollectiveTimeoutError", "gave_up_waiting", "translating_timeouts"]


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


@contextlib.contextmanager
def translating_timeouts(step: str, where: Callable[[], str], *, sequenced: bool) -> Iterator[None]:
    """FSDP's own collectives of ``step`` in ``where()`` (the root, or a unit; asked only on a
    timeout): a backend that gives up waiting becomes a ``CollectiveTimeoutError``;
    ``sequenced``: the ranks agree on every event (``ranks_may_diverge``), so divergent paths are
    not the cause."""
    try:
        yield
    except RuntimeError as error:
        if not gave_up_waiting(error):
            raise
        mode = (
            "even with ranks_may_diverge=True: a rank stopped, died or is still busy"
            if sequenced
            else "a rank stopped, died or is still busy, or the ranks' models took different paths (a wrapped "
            "module skipped, or its output left unused, on some ranks only: pass ranks_may_diverge=True "
            "for models that do that)"
        )
        raise CollectiveTimeoutError(
            f"FSDP: rank {dist.get_rank()} gave up waiting for the other ranks in the {step} of {where()}: {mode}. "
            f"Backend: {_first_line(error)}"
        ) from error


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
