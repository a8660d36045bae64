"""Fixtures shared by test modules."""

import signal
from collections.abc import Iterator

import pytest


@pytest.fixture
def sigint_reaches_children() -> Iterator[None]:
    """For tests that send SIGINT to a process they start: a shell starts a background job
    (``bash .ci/run &``) with SIGINT ignored, and an ignored signal stays ignored across exec,
    so the child would never see it. Handled here for the test, it reaches the child with its
    default disposition (a handled signal is reset on exec)."""
    previous = signal.getsignal(signal.SIGINT)
    if previous is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
