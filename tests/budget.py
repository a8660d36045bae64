"""Hypothesis budgets: the test command's, and a larger one on demand.

``budget(n)`` is the ``settings`` of a property worth ``n`` examples in the test command:
derandomized (the same examples every run, so CI cannot fail by chance), no per-example
deadline. With ``FSDP_HYPOTHESIS=nightly`` every property gets ten times its examples, drawn at
random, the way a nightly job would search: ``FSDP_HYPOTHESIS=nightly bash scripts/test.sh --quick``.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

__all__ = ["NIGHTLY", "budget"]

NIGHTLY = os.environ.get("FSDP_HYPOTHESIS") == "nightly"
"""Whether the larger, random search was asked for."""


def budget(max_examples: int) -> settings:
    """``max_examples`` derandomized examples, or ten times as many random ones when ``NIGHTLY``."""
    return settings(
        deadline=None,
        max_examples=max_examples * (10 if NIGHTLY else 1),
        derandomize=not NIGHTLY,
        database=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
