"""The converters from torch's FSDP1 config objects, without a process group."""

from __future__ import annotations

import pytest
from torch.distributed.fsdp import BackwardPrefetch as TorchBackwardPrefetch
from torch.distributed.fsdp import ShardingStrategy as TorchStrategy

from fsdp_core import BackwardPrefetch
from fsdp_shell.options import to_backward_prefetch


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, None),
        (BackwardPrefetch.BACKWARD_PRE, BackwardPrefetch.BACKWARD_PRE),
        (TorchBackwardPrefetch.BACKWARD_PRE, BackwardPrefetch.BACKWARD_PRE),
        (TorchBackwardPrefetch.BACKWARD_POST, BackwardPrefetch.BACKWARD_POST),
        ("BACKWARD_POST", BackwardPrefetch.BACKWARD_POST),
        ("backward_pre", BackwardPrefetch.BACKWARD_PRE),
        ("none", None),
    ],
)
def test_to_backward_prefetch_accepts_ours_torchs_and_names(value: object, expected: BackwardPrefetch | None) -> None:
    assert to_backward_prefetch(value) is expected


@pytest.mark.parametrize(
    ("value", "error"),
    [
        (True, TypeError),
        (1, TypeError),
        (TorchBackwardPrefetch, TypeError),
        ("sideways", ValueError),
        (TorchStrategy.FULL_SHARD, ValueError),
    ],
)
def test_to_backward_prefetch_rejects_the_rest_naming_the_argument(value: object, error: type[Exception]) -> None:
    with pytest.raises(error, match="backward_prefetch") as info:
        to_backward_prefetch(value)
    assert "BACKWARD_PRE, BACKWARD_POST" in str(info.value)
