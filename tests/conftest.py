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


@pytest.fixture(scope="session", autouse=True)
def _kept_worlds_end_with_the_session() -> Iterator[None]:
    """The gloo worlds ``tests.worlds.dist_harness`` keeps across cases end cleanly when the
    session does, so coverage.py saves what their ranks ran."""
    yield
    from tests.worlds.dist_harness import close_worlds

    close_worlds()
