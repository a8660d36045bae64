"""The iteration simulator's renderings: the text timeline (its rows, width and shared links) and
the Chrome trace. Expected rows and times are worked out by hand.
"""

from __future__ import annotations

import json

import pytest

from fsdp_core.sim import ACTIVITY_MARKS, Activity, LinkModel, format_iteration, iteration_to_trace, simulate_iteration
from tests.core.iteration_cases import FSDP, HSDP_ASYNC, HSDP_SYNC, small

# -- renderings ---------------------------------------------------------------------------------


def test_format_iteration_rows_and_width() -> None:
    t = simulate_iteration(small(HSDP_ASYNC))
    text = format_iteration(t, width=57)
    lines = text.splitlines()
    assert lines[0].startswith("HYBRID_SHARD 2 x 8, async all-reduce: 57.0 ms per iteration, one column = 1.00 ms")
    assert lines[-1].startswith("  g/G forward/backward all-gather")
    rows = {line.split("|")[0].strip(): line.split("|")[1] for line in lines[1:-1]}
    assert list(rows) == ["compute", "all_gather", "post_backward", "all_reduce", "intra_node", "inter_node"]
    assert all(len(row) == 57 for row in rows.values())
    # u2's all-reduce runs 17-37 ms and u1's 37-57: one column per ms.
    assert rows["all_reduce"] == " " * 17 + "A" * 40
    assert rows["compute"][3] == "f" and rows["compute"][11:13] == "bb"
    with pytest.raises(ValueError, match="width"):
        format_iteration(t, width=5)


def test_format_iteration_counts_collectives_sharing_a_link() -> None:
    t = simulate_iteration(small(FSDP), LinkModel(one_collective_per_group=False))
    row = next(line for line in format_iteration(t, width=62).splitlines() if line.startswith("  inter_node"))
    assert row.split("|")[1][34:50] == "2" * 16


def test_iteration_to_trace() -> None:
    t = simulate_iteration(small(HSDP_SYNC))
    trace = iteration_to_trace(t, name="small")
    assert json.loads(json.dumps(trace)) == trace
    events = trace["traceEvents"]
    assert isinstance(events, list) and trace["displayTimeUnit"] == "ms"
    complete = [e for e in events if isinstance(e, dict) and e["ph"] == "X"]
    assert len(complete) == len(t.intervals)
    names = [e["args"] for e in events if isinstance(e, dict) and e["name"] in ("process_name", "thread_name")]
    assert names == [{"name": n} for n in ("small", "compute", "all_gather", "post_backward", "all_reduce")]
    ar = next(e for e in complete if e["name"] == "u1 all_reduce")
    assert (ar["ts"], ar["dur"]) == (40_000.0, 20_000.0)
    counters = [e for e in events if isinstance(e, dict) and e["ph"] == "C"]
    assert {e["name"] for e in counters} == {"intra_node collectives", "inter_node collectives"}
    assert all(isinstance(e["args"], dict) and e["args"]["active"] in (0, 1) for e in counters)


def test_activity_marks_cover_every_activity() -> None:
    assert set(ACTIVITY_MARKS) == set(Activity) and len(set(ACTIVITY_MARKS.values())) == len(Activity)
