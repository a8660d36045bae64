"""The execution rules of ``fsdp_core.execution``, one hand-worked case each. The runtime
(``fsdp_shell.runtime.cpu``), the memory model and the simulator all call these; that they then
agree with the runtime is shown to the byte by tests/worlds/test_memory_gloo.py and
tests/worlds/test_predict_gloo.py."""

from __future__ import annotations

from fsdp_core import Group, HybridAllReduce, ReduceKind, Stream
from fsdp_core.execution import (
    ALL_TO_ALL_MAX_BYTES,
    ASYNC_GATHER_MAX_BYTES,
    BROADCAST_GATHER_MIN_BYTES,
    PLANS_IN_FLIGHT,
    LaneOrder,
    Place,
    ScatterForm,
    gather_by_broadcasts,
    gather_waits,
    lane_issues_shard,
    scatter_form,
)

PB, AR = Stream.POST_BACKWARD, Stream.ALL_REDUCE


def test_replicate_collectives_go_to_the_lane_and_what_they_use_waits_behind_them() -> None:
    lane: LaneOrder[str] = LaneOrder()
    assert lane.begin_plan() == 0
    assert lane.collective(PB, Group.SHARD, ("grad", "shard")) is Place.HOST
    assert lane.collective(AR, Group.REPLICATE, ("shard",)) is Place.LANE
    assert lane.submitted == 1
    # the next op on the shard buffer is behind the all-reduce; one on a fresh buffer is not
    assert lane.compute(PB, ("shard",)) is Place.LANE
    assert lane.compute(Stream.COMPUTE, ("other",)) is Place.HOST
    # the all-reduce stream has lane work: work queued there follows it
    assert lane.compute(AR, ("other",)) is Place.LANE
    assert lane.keys_behind() == frozenset({AR, Group.REPLICATE, PB})
    # touching the gradient on the host waits for the whole lane
    assert lane.on_host(("shard",)) is Place.HOST_AFTER_DRAIN
    assert lane.on_host(("fresh",)) is Place.HOST


def test_a_shard_collective_behind_drains_first_unless_the_lane_issues_that_group() -> None:
    for issues, expected in ((False, Place.HOST_AFTER_DRAIN), (True, Place.LANE)):
        lane: LaneOrder[str] = LaneOrder(lane_issues_shard=issues)
        lane.collective(PB, Group.REPLICATE, ("g",))
        assert lane.collective(PB, Group.SHARD, ("h",)) is expected
    assert lane_issues_shard(HybridAllReduce.SYNC) and not lane_issues_shard(HybridAllReduce.ASYNC)


def test_memory_lane_work_uses_returns_when_the_host_has_waited_for_it() -> None:
    lane: LaneOrder[str] = LaneOrder()
    assert PLANS_IN_FLIGHT == 1
    lane.begin_plan()
    lane.collective(AR, Group.REPLICATE, ("a",))  # ticket 1, plan 0
    assert lane.free("a", "a's memory") is False and lane.free("b", "b's memory") is True
    assert lane.pending() == ["a's memory"]
    # plan 1 starts: plan 0 is the one plan allowed in flight, nothing is waited for
    assert lane.begin_plan() == 0
    lane.collective(AR, Group.REPLICATE, ("c",))  # ticket 2, plan 1
    lane.free("c", "c's memory")
    assert lane.behind((), ("a",))  # plan 0's lane work is in flight while plan 1 runs
    # plan 2 starts: the host waits for plan 0's lane work (ticket 1) and gets its memory back
    ticket = lane.begin_plan()
    assert ticket == 1
    assert lane.waited_through(ticket) == ["a's memory"]
    assert lane.waited_through(ticket) == []
    assert lane.behind((), ("c",)) and not lane.behind((), ("a",))
    fork = lane.fork()
    assert fork.drain() == ["c's memory"] and lane.pending() == ["c's memory"]
    assert lane.drain() == ["c's memory"] and lane.waited == lane.submitted == 2
    assert not lane.behind((AR, Group.REPLICATE), ("c",))


def test_gloo_forms_follow_the_sizes() -> None:
    small, large = ALL_TO_ALL_MAX_BYTES, ALL_TO_ALL_MAX_BYTES + 1
    assert scatter_form(ReduceKind.SUM, large, gloo=True, src_dies=True) is ScatterForm.ALL_REDUCE
    assert scatter_form(ReduceKind.SUM, large, gloo=True, src_dies=False) is ScatterForm.ALL_TO_ALL
    assert scatter_form(ReduceKind.SUM, small, gloo=True, src_dies=True) is ScatterForm.ALL_TO_ALL
    assert scatter_form(ReduceKind.SUM, small, gloo=False, src_dies=True) is ScatterForm.NATIVE
    assert scatter_form(ReduceKind.AVG, small, gloo=True, src_dies=True) is ScatterForm.NATIVE
    assert [f.receive_buffer for f in ScatterForm] == [False, True, False, False]
    for kind in (ReduceKind.SUM, ReduceKind.AVG):
        assert scatter_form(kind, large, gloo=True, src_dies=True, ranks=1) is ScatterForm.LOCAL
    assert scatter_form(ReduceKind.PREMUL_SUM, small, gloo=False, src_dies=True, ranks=1) is ScatterForm.NATIVE
    assert not gather_waits(ASYNC_GATHER_MAX_BYTES) and gather_waits(ASYNC_GATHER_MAX_BYTES + 1)
    assert BROADCAST_GATHER_MIN_BYTES == 2 << 20
    assert gather_by_broadcasts(2 << 20) and not gather_by_broadcasts((2 << 20) - 1)
