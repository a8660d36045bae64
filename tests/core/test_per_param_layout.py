"""The per-parameter (FSDP2) layout: chunks, padding and rank-major offsets worked out by hand,
``torch.chunk``'s rule for every shape, and the copy-in / copy-out round trip its offsets
describe. (PyTorch's own ``fully_shard`` against it: ``tests/shell/test_per_param_fsdp2.py``.)"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fsdp_core import PerParamLayout, ShardedParam, UnitDtypes, unit_dtypes


def linear_10_9(world: int) -> PerParamLayout:
    return PerParamLayout.of([("weight", (9, 10)), ("bias", (9,))], torch.float32, world)


def test_a_linear_on_two_ranks_by_hand() -> None:
    """9 rows over 2 ranks: chunks of 5, rank 1 holds 4. The weight's padded shard is 5 x 10 = 50
    elements, the bias's 5; one rank's slice is 55, the buffers 110."""
    layout = linear_10_9(2)
    assert layout.chunk_rows == (5, 5)
    assert layout.padded_shard_numel == (50, 5)
    assert layout.shard_offsets == (0, 50)
    assert (layout.slice_numel, layout.padded_numel) == (55, 110)
    assert [layout.rows(0, r) for r in range(2)] == [5, 4]
    assert layout.sharded_shape(0, 1) == (4, 10)
    assert layout.padded_sharded_shape(0) == (5, 10)
    assert layout.padded_unsharded_shape(1) == (10,)
    # rank 1's chunk of the bias: after rank 0's slice (55) and rank 1's weight chunk (50)
    assert layout.chunk_at(1, 1) == (105, 5)
    assert layout.chunk_at(0, 0) == (0, 50)


def test_the_last_ranks_may_hold_nothing() -> None:
    """5 rows over 4 ranks: torch.chunk makes chunks of 2, 2 and 1, and rank 3 holds none, as a
    (0, 3) tensor (its other dimensions kept, as FSDP2's sharded size keeps them)."""
    layout = PerParamLayout.of([("w", (5, 3))], torch.bfloat16, 4)
    assert layout.chunk_rows == (2,)
    assert [layout.rows(0, r) for r in range(4)] == [2, 2, 1, 0]
    assert layout.sharded_shape(0, 3) == (0, 3)
    assert layout.padded_shard_numel == (6,)
    assert layout.padded_unsharded_shape(0) == (8, 3)


def test_another_shard_dimension_divides_evenly() -> None:
    """Shard(1) of a 4 x 6 parameter over 3 ranks: chunks of 2 columns, 8 elements each."""
    layout = PerParamLayout.of([("w", (4, 6), 1), ("b", (7,))], torch.float32, 3)
    assert layout.chunk_rows == (2, 3)
    assert layout.padded_shard_numel == (8, 3)
    assert layout.sharded_shape(0, 2) == (4, 2)
    assert layout.chunk_at(1, 2) == (2 * 11 + 8, 3)


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: PerParamLayout.of([("w", (4, 5), 1)], torch.float32, 2), r"params\['w'\]: dimension 1 of size 5"),
        (lambda: PerParamLayout.of([("s", ())], torch.float32, 2), r"params\['s'\]: a scalar parameter"),
        (lambda: PerParamLayout.of([("w", (4,), 1)], torch.float32, 2), r"params\['w'\]\.shard_dim: expected 0 <="),
        (lambda: PerParamLayout.of([("w", (4,)), ("w", (2,))], torch.float32, 2), r"duplicate parameter names \['w'\]"),
        (lambda: PerParamLayout.of([("w", (4,))], torch.float32, 0), r"world: expected an int >= 1"),
        (lambda: PerParamLayout.of([], torch.float32, 2), r"params: expected a non-empty tuple"),
        (lambda: linear_10_9(2).rows(0, 2), r"rank: expected 0 <= rank < 2, got 2"),
        (
            lambda: PerParamLayout(
                params=(ShardedParam(name="w", shape=(4,)),), dtype=torch.float32, world=2, slice_numel=3
            ),
            r"slice_numel: 3 disagrees with the layout 2",
        ),
    ],
    ids=[
        "uneven-dim-1",
        "scalar",
        "dim-out-of-range",
        "duplicate",
        "no-ranks",
        "no-params",
        "rank",
        "derived",
    ],
)
def test_bad_input_is_refused_by_name(build: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build()  # type: ignore[operator]  # each case is a zero-argument callable


def test_a_non_float_dtype_is_a_type_error() -> None:
    with pytest.raises(TypeError, match="dtype: expected a floating dtype"):
        PerParamLayout(params=(ShardedParam(name="w", shape=(4,)),), dtype=torch.int32, world=2)


shapes = st.lists(st.integers(0, 7), min_size=1, max_size=3).map(tuple)


@given(shape=shapes, world=st.integers(1, 6), data=st.data())
def test_rows_are_torch_chunks(shape: tuple[int, ...], world: int, data: st.DataObject) -> None:
    """Every rank's rows are the size of its ``torch.chunk`` (FSDP2's rule), none past the last
    chunk; the padded chunk is the first chunk's size."""
    dims = [d for d in range(len(shape)) if d == 0 or shape[d] % world == 0]
    dim = data.draw(st.sampled_from(dims))
    layout = PerParamLayout.of([("p", shape, dim)], torch.float32, world)
    chunks = torch.chunk(torch.empty(shape), world, dim=dim)
    want = [c.size(dim) for c in chunks] + [0] * (world - len(chunks))
    assert [layout.rows(0, r) for r in range(world)] == want
    assert layout.chunk_rows[0] == (want[0] if shape[dim] else 0)


@given(
    shapes=st.lists(st.lists(st.integers(1, 6), min_size=1, max_size=3).map(tuple), min_size=1, max_size=4),
    world=st.integers(1, 5),
)
def test_copy_in_then_copy_out_gives_every_parameter_back(shapes: list[tuple[int, ...]], world: int) -> None:
    """Each parameter padded on dim 0 to ``world`` chunks, chunk ``r`` copied to ``chunk_at(i, r)``
    of the rank-major buffer (FSDP2's copy-in) and read back from there (its copy-out): every
    parameter comes back, and every element of the buffer outside the parameters' rows is
    padding."""
    layout = PerParamLayout.of([(f"p{i}", s) for i, s in enumerate(shapes)], torch.float64, world)
    values = [
        torch.arange(1, 1 + torch.Size(s).numel(), dtype=torch.float64).view(s) + 100 * i for i, s in enumerate(shapes)
    ]
    buffer = torch.zeros(layout.padded_numel, dtype=torch.float64)
    for i, v in enumerate(values):
        padded = torch.zeros(layout.padded_unsharded_shape(i), dtype=torch.float64)
        padded[: v.size(0)] = v
        for r, chunk in enumerate(padded.chunk(world)):
            offset, numel = layout.chunk_at(i, r)
            buffer[offset : offset + numel] = chunk.reshape(-1)
    assert int(buffer.count_nonzero()) == sum(v.numel() for v in values)
    for i, v in enumerate(values):
        pieces = [
            buffer[o : o + n].view(layout.padded_sharded_shape(i))
            for o, n in (layout.chunk_at(i, r) for r in range(world))
        ]
        assert torch.equal(torch.cat(pieces)[: v.size(0)], v)
        own = v.chunk(world)  # each rank's rows, as FSDP2's sharded parameter holds them
        for r, piece in enumerate(pieces):
            rows = layout.rows(i, r)
            assert rows == (own[r].size(0) if r < len(own) else 0)
            assert torch.equal(piece[:rows], own[r][:rows] if rows else piece[:0])


def test_unit_dtypes_by_hand() -> None:
    """bf16 compute with fp32 reduction; a reduce dtype equal to the param dtype reduces in the
    compute dtype; nothing set: everything in the parameters' dtype."""
    f32, bf16 = torch.float32, torch.bfloat16
    assert unit_dtypes(f32, bf16, f32) == UnitDtypes(orig=f32, compute=bf16, reduce=f32)
    assert unit_dtypes(f32, bf16, bf16) == UnitDtypes(orig=f32, compute=bf16, reduce=bf16)
    assert unit_dtypes(f32, bf16, None) == UnitDtypes(orig=f32, compute=bf16, reduce=bf16)
    assert unit_dtypes(f32, None, bf16) == UnitDtypes(orig=f32, compute=f32, reduce=bf16)
    assert unit_dtypes(bf16, None, None) == UnitDtypes(orig=bf16, compute=bf16, reduce=bf16)
    with pytest.raises(TypeError, match=r"reduce_dtype: expected a floating dtype or None, got torch\.int8"):
        unit_dtypes(f32, None, torch.int8)
