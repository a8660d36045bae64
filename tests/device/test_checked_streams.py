"""The accelerator runtime on the checked-streams device (``tests/device/checked_streams.py``).

First the checker itself: each rule raises on the smallest program that breaks it and stays
quiet once the missing wait, event or ``record_stream`` is added. Then the training cases of
``test_fsdp_gloo`` run a second time with every tree on ``AcceleratorRuntime`` over the checked
device (gloo underneath): every strategy, flat and ``use_orig_params``, mixed precision, CPU
offload, ``no_sync`` and accumulation, comm hooks, every backward-prefetch mode and forward
prefetch, hybrid sync and async, the division policies, and the state-dict round trip, each
against the same single-process reference, with no use the streams leave unordered. (FSDP1 is
left out of these runs: the first run compares against it.) The state-dict semantics and the
recovery from a step that fails inside backward run on it too. So do the ``fully_shard`` parity
cases of ``test_fully_shard_gloo`` (against PyTorch's FSDP2, both under the checker; a
``DTensor`` counts as the local tensor it wraps). Last, mutation tests: with one
synchronisation removed from the runtime or the plan, the checker raises, for both APIs (for
``fully_shard`` also the HSDP aliasing of PyTorch PR 180889).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.distributed as dist

from fsdp_core import Op, RecordStream, Stream, WaitStream
from fsdp_shell.runtime import accelerator
from fsdp_shell.runtime.accelerator import AcceleratorRuntime
from fsdp_shell.runtime.collectives import CollectiveLog
from fsdp_shell.runtime.groups import ProcessGroups
from fsdp_shell.runtime.interpreter import PlanRun
from tests.device.checked_streams import CheckedDevice, StreamChecker, StreamRaceError, checked_streams
from tests.worlds.dist_harness import run_world
from tests.worlds.fault_cases import recovery
from tests.worlds.fsdp_cases import Case, Outcome, check_outcomes, run_cases
from tests.worlds.state_dict_cases import semantics
from tests.worlds.test_fsdp_gloo import FLAT_CASES, HYBRID_CASES
from tests.worlds.test_fully_shard_gloo import CASES as FULLY_SHARD_CASES
from tests.worlds.test_fully_shard_gloo import Case as FullyShardCase
from tests.worlds.test_fully_shard_gloo import hook_against_fsdp2, tp_against_fsdp2, train_against_fsdp2
from tests.worlds.test_state_dict_gloo import check_semantics

# -- the rules, on the smallest programs -------------------------------------------------------


@pytest.fixture
def device() -> Iterator[CheckedDevice]:
    checker = StreamChecker()
    with checker:
        yield CheckedDevice(checker)


def test_a_read_of_another_streams_write_needs_a_wait(device: CheckedDevice) -> None:
    side, main = device.new_stream("side"), device.current_stream()
    x = torch.ones(8)
    with (
        pytest.raises(StreamRaceError, match=r"aten.mul.Tensor on stream 'side' reads .* no wait or event"),
        device.use_stream(side),
    ):
        x * 2
    device.wait_stream(side, main)
    with device.use_stream(side):
        y = x * 2
    with pytest.raises(StreamRaceError, match=r"on stream 'default' reads .* which aten.mul.Tensor on stream 'side'"):
        y + 1
    device.wait_event(main, device.record_event(side))
    assert float((y + 1).sum()) == 24.0


def test_a_write_over_another_streams_read_needs_a_wait(device: CheckedDevice) -> None:
    side, main = device.new_stream("side"), device.current_stream()
    x = torch.ones(8)
    device.wait_stream(side, main)
    with device.use_stream(side):
        x.sum()
    with pytest.raises(StreamRaceError, match=r"aten.fill_.Scalar on stream 'default' writes .* read"):
        x.fill_(2.0)
    device.wait_stream(main, side)
    x.fill_(2.0)


def _used_on(device: CheckedDevice, side: object) -> torch.Tensor:
    main = device.current_stream()
    x = torch.ones(8) * 3
    device.wait_stream(side, main)  # type: ignore[arg-type]  # a CheckedStream
    with device.use_stream(side):  # type: ignore[arg-type]  # a CheckedStream
        x.sum()
    return x


def test_memory_freed_while_another_stream_uses_it_is_not_reused_unrecorded(device: CheckedDevice) -> None:
    side = device.new_stream("side")
    x = _used_on(device, side)
    del x
    with pytest.raises(StreamRaceError, match=r"allocates, and may reuse .* recorded there"):
        torch.zeros(3)
    x = _used_on(device, side)
    device.record_stream(x, side)
    del x
    torch.zeros(3)
    x = _used_on(device, side)
    x.untyped_storage().resize_(0)
    with pytest.raises(StreamRaceError, match=r"may reuse"):
        torch.zeros(3)
    x = _used_on(device, side)
    device.wait_stream(device.current_stream(), side)
    del x
    torch.zeros(3)


def test_the_host_reads_a_copy_only_after_waiting_for_it(device: CheckedDevice) -> None:
    side, main = device.new_stream("side"), device.current_stream()
    src = torch.ones(8)
    host = device.pinned_empty(8, torch.float32)
    assert not device.holds(host) and device.holds(src)
    device.wait_stream(side, main)
    with device.use_stream(side):
        host.copy_(src, non_blocking=True)
    with pytest.raises(StreamRaceError, match=r"on the host reads .* before the host synchronized"):
        host.sum()
    device.host_wait(device.record_event(side))
    assert float(host.sum()) == 8.0
    with device.use_stream(side):
        y = src * 2
    with pytest.raises(StreamRaceError, match=r"aten._local_scalar_dense.default on the host"):
        y[0].item()
    device.synchronize(side)
    assert y[0].item() == 2.0


# -- the training cases on the checked device --------------------------------------------------

PREFETCH_CASES: tuple[Case, ...] = (
    Case(name="FULL-prefetch-post", backward_prefetch="BACKWARD_POST", fsdp1=False),
    Case(name="FULL-prefetch-none", backward_prefetch=None, fsdp1=False),
    Case(name="FULL-forward-prefetch-orig", forward_prefetch=True, use_orig_params=True, fsdp1=False),
    Case(name="FULL-bf16-forward-prefetch", mp="bf16", forward_prefetch=True, fsdp1=False),
)
CHECKED_FLAT = tuple(dataclasses.replace(c, fsdp1=False) for c in FLAT_CASES) + PREFETCH_CASES
CHECKED_HYBRID = tuple(dataclasses.replace(c, fsdp1=False) for c in HYBRID_CASES)


def run_checked(rank: int, world: int, cases: tuple[Case, ...]) -> tuple[dict[str, Outcome], int, int]:
    """``cases`` with every tree on the accelerator runtime over one checked device; also how
    many runtimes were made on it and how many ops the checker checked."""
    with checked_streams() as checker:
        outcomes = run_cases(rank, world, cases)
    return outcomes, checker.runtimes, checker.ops_checked


Checked = list[tuple[dict[str, Outcome], int, int]]


@pytest.fixture(scope="module")
def checked_flat() -> Checked:
    return run_world(2, run_checked, CHECKED_FLAT, timeout=600)


@pytest.fixture(scope="module")
def checked_hybrid() -> Checked:
    return run_world(4, run_checked, CHECKED_HYBRID, timeout=600)


@pytest.mark.parametrize("case", CHECKED_FLAT, ids=lambda c: c.name)
def test_flat_cases_on_the_checked_device(case: Case, checked_flat: Checked) -> None:
    check_outcomes(case, [outcomes[case.name] for outcomes, _, _ in checked_flat])
    assert all(runtimes == len(CHECKED_FLAT) and ops > 10_000 for _, runtimes, ops in checked_flat)


@pytest.mark.parametrize("case", CHECKED_HYBRID, ids=lambda c: c.name)
def test_hybrid_cases_on_the_checked_device(case: Case, checked_hybrid: Checked) -> None:
    check_outcomes(case, [outcomes[case.name] for outcomes, _, _ in checked_hybrid])
    assert all(runtimes == len(CHECKED_HYBRID) and ops > 10_000 for _, runtimes, ops in checked_hybrid)


def checked_semantics(rank: int, world: int, _: None) -> tuple[dict[str, object], int]:
    """``state_dict_cases.semantics`` (``state_dict``/``load_state_dict`` as on the unwrapped
    module: keys, tied weights, ``rank0_only``, partial and strict loads) on the checked device."""
    with checked_streams() as checker:
        return semantics(rank, world, None), checker.runtimes


def test_state_dicts_on_the_checked_device() -> None:
    per_rank = run_world(2, checked_semantics, None, timeout=120)
    check_semantics([out for out, _ in per_rank])
    assert all(runtimes > 0 for _, runtimes in per_rank)


def checked_recovery(rank: int, world: int, use_orig_params: bool) -> tuple[float, int]:
    """``fault_cases.recovery`` (a step failing in the loss, one in a comm hook inside backward,
    then training on) on the checked device: the abandoned backward's buffers included."""
    with checked_streams() as checker:
        return recovery(rank, world, use_orig_params), checker.runtimes


def test_a_failed_step_on_the_checked_device_leaves_the_wrapper_usable() -> None:
    for diff, runtimes in run_world(2, checked_recovery, True, timeout=120):
        assert diff <= 1e-6 and runtimes > 0


def host_copies(rank: int, world: int, _: None) -> tuple[bool, float]:
    """The runtime's ``to_host``: a host tensor comes back as it is; a device tensor is copied
    into the buffer, and the host reads it once ``drain`` has synchronized every stream."""
    with checked_streams() as checker:
        device = CheckedDevice(checker)
        groups = ProcessGroups(dist.distributed_c10d._get_default_group(), None)
        runtime = AcceleratorRuntime(groups, CollectiveLog(), device)
        host = device.pinned_empty(4, torch.float32)
        kept = runtime.to_host(Stream.POST_BACKWARD, host, lambda: torch.empty(0)) is host
        src = torch.full((4,), 2.0)
        runtime.wait_stream(Stream.POST_BACKWARD, Stream.COMPUTE)
        copied = runtime.to_host(Stream.POST_BACKWARD, src, lambda: device.pinned_empty(4, torch.float32))
        runtime.drain()
        return kept, float(copied.sum())


def test_to_host_keeps_host_tensors_and_drain_lets_the_host_read_copies() -> None:
    assert run_world(1, host_copies, None, timeout=60) == [(True, 8.0)]


# -- mutations: one synchronisation removed, the checker raises ---------------------------------


def _skip_plan_op(skip: Callable[[Op], bool]) -> contextlib.AbstractContextManager[None]:
    step = PlanRun._step

    def mutated(self: PlanRun, op: Op) -> None:
        if skip(op):
            self._index += 1
            return
        step(self, op)

    return _patched(PlanRun, "_step", mutated)


@contextlib.contextmanager
def _patched(owner: object, name: str, value: object) -> Iterator[None]:
    old = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, old)


def _without_host_waits(self: AcceleratorRuntime[object, object], stream: Stream, waits_for: Stream) -> None:
    self.wait_stream(stream, waits_for)
    self._host_copies = []


MUTATIONS: dict[str, tuple[Callable[[], contextlib.AbstractContextManager[None]], Case, str]] = {
    "post-backward-wait_stream": (
        lambda: _skip_plan_op(lambda op: isinstance(op, WaitStream) and op.stream is Stream.POST_BACKWARD),
        Case(name="FULL", fsdp1=False, steps=1),
        "on stream 'post_backward' (reads|writes) .* on stream 'default' wrote, with no wait",
    ),
    "unsharded-grad-record_stream": (
        lambda: _skip_plan_op(lambda op: isinstance(op, RecordStream)),
        Case(name="FULL", fsdp1=False, steps=1),
        "on stream 'default' allocates, and may reuse .* on stream 'post_backward'",
    ),
    "offload-event": (
        lambda: _patched(AcceleratorRuntime, "end_of_backward", _without_host_waits),
        Case(name="FULL-offload", offload=True, fsdp1=False, steps=1),
        "on the host (reads|writes) .* before the host synchronized",
    ),
    "all-gather-event": (
        lambda: _patched(accelerator._EventWait, "wait", lambda self: True),
        Case(name="FULL", fsdp1=False, steps=1),
        "on stream 'default' reads .* on stream 'all_gather' wrote, with no wait",
    ),
}


def _raised(mutate: Callable[[], contextlib.AbstractContextManager[None]], run: Callable[[], object]) -> str | None:
    """The checker's message when ``run`` on the checked device, with ``mutate`` applied, makes it
    raise; else None."""
    with checked_streams(), mutate():
        try:
            run()
        except StreamRaceError as error:
            return str(error)
    return None


def run_mutations(rank: int, world: int, names: tuple[str, ...]) -> dict[str, str | None]:
    """Each mutation applied in turn to one case on the checked device: the checker's message,
    or None when it raised nothing."""
    return {
        name: _raised(MUTATIONS[name][0], functools.partial(run_cases, rank, world, (MUTATIONS[name][1],)))
        for name in names
    }


@pytest.fixture(scope="module")
def mutated() -> dict[str, str | None]:
    return run_world(1, run_mutations, tuple(MUTATIONS), timeout=300)[0]


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_removing_one_synchronisation_makes_the_checker_raise(name: str, mutated: dict[str, str | None]) -> None:
    message = mutated[name]
    assert message is not None, f"{name}: the checker raised nothing"
    assert re.search(MUTATIONS[name][2], message), message


# -- fully_shard on the checked device ------------------------------------------------------------


def checked_fully_shard(rank: int, world: int, cases: tuple[FullyShardCase, ...]) -> tuple[list[list[str]], int, int]:
    """``cases`` of ``test_fully_shard_gloo`` (ours against PyTorch's FSDP2) with every
    ``fully_shard`` root on the accelerator runtime over one checked device: each case's
    problems, the runtimes made on the device and the ops checked."""
    with checked_streams() as checker:
        problems = [train_against_fsdp2(rank, world, case) for case in cases]
    return problems, checker.runtimes, checker.ops_checked


@pytest.mark.parametrize("world", [2, 4])
def test_fully_shard_cases_on_the_checked_device(world: int) -> None:
    """Every parity case of ``fully_shard`` (meshes, resharding to smaller groups, mixed
    precision, offload, accumulation, prefetch, meta init, ``torch.compile``...) trains as
    FSDP2 does with no use its streams leave unordered."""
    cases = tuple(c for c in FULLY_SHARD_CASES if c.world == world)
    results = run_world(world, checked_fully_shard, cases, timeout=600)
    for problems, runtimes, ops in results:
        assert problems == [[]] * len(cases)
        assert runtimes >= len(cases) and ops > 1000 * len(cases)


def checked_tp_and_hook(rank: int, world: int, _: None) -> tuple[list[str], list[str], int]:
    with checked_streams() as checker:
        return tp_against_fsdp2(rank, world, None), hook_against_fsdp2(rank, world, None), checker.runtimes


def test_fully_shard_with_tensor_parallelism_and_an_all_reduce_hook_on_the_checked_device() -> None:
    for tp, hook, runtimes in run_world(4, checked_tp_and_hook, None, timeout=300):
        assert (tp, hook) == ([], []) and runtimes >= 2


FULLY_SHARD_MUTATIONS: dict[str, tuple[Callable[[], contextlib.AbstractContextManager[None]], FullyShardCase, str]] = {
    "post-backward-wait_stream": (
        lambda: _skip_plan_op(lambda op: isinstance(op, WaitStream) and op.stream is Stream.POST_BACKWARD),
        FullyShardCase(2, (2,), steps=1),
        "on stream 'post_backward' (reads|writes) .* on stream 'default' wrote, with no wait",
    ),
    "all-gather-event": (
        lambda: _patched(accelerator._EventWait, "wait", lambda self: True),
        FullyShardCase(2, (2,), steps=1),
        "on stream 'default' (reads|writes) .* on stream 'all_gather' wrote, with no wait",
    ),
    # PyTorch PR 180889: a reduce-scatter output freed to the post-backward stream's pool while the
    # all-reduce stream still uses it (here: adds it into the .grad the first micro-batch left)
    "hsdp-all-reduce-record_stream": (
        lambda: _skip_plan_op(lambda op: isinstance(op, RecordStream) and op.stream is Stream.ALL_REDUCE),
        FullyShardCase(4, (2, 2), micro=2, sync_every_micro=True, steps=1),
        "on stream '(post_backward|default)' allocates, and may reuse .* on stream 'all_reduce'",
    ),
}


def run_fully_shard_mutations(rank: int, world: int, names: tuple[str, ...]) -> dict[str, str | None]:
    """Each ``fully_shard`` mutation of a ``world``-rank case in turn on the checked device: the
    checker's message, or None when it raised nothing."""
    return {
        name: _raised(
            FULLY_SHARD_MUTATIONS[name][0],
            functools.partial(train_against_fsdp2, rank, world, FULLY_SHARD_MUTATIONS[name][1]),
        )
        for name in names
    }


@pytest.mark.parametrize("name", list(FULLY_SHARD_MUTATIONS))
def test_removing_one_synchronisation_of_fully_shard_makes_the_checker_raise(name: str) -> None:
    case = FULLY_SHARD_MUTATIONS[name][1]
    message = run_world(case.world, run_fully_shard_mutations, (name,), timeout=300)[0][name]
    assert message is not None, f"{name}: the checker raised nothing"
    assert re.search(FULLY_SHARD_MUTATIONS[name][2], message), message
