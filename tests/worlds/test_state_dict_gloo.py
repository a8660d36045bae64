"""State dicts keep the unwrapped module's semantics on a gloo world (``tests/worlds/state_dict_cases.py``)."""

from __future__ import annotations

from tests.worlds.dist_harness import run_world
from tests.worlds.state_dict_cases import semantics


def test_state_dict_has_the_unwrapped_modules_semantics() -> None:
    check_semantics(run_world(2, semantics, None, timeout=120))


def check_semantics(per_rank: list[dict[str, object]]) -> None:
    """What ``semantics`` measured on each rank of a world of 2."""
    for rank, out in enumerate(per_rank):
        assert out["keys"] is True  # persistent buffers only, _extra_state, both names of the tied weight
        assert out["extra"] == {"calls": 1}
        assert out["tied"] is True and out["loaded"] is True
        assert (out["rank0_only_len"] != 0) == (rank == 0)  # FullStateDictConfig(rank0_only=True)
        assert out["back_to_default"] is True
        missing = out["missing"]
        assert isinstance(missing, list) and missing and all(not k.startswith("body.2.") for k in missing)
        assert out["unexpected"] == []
        assert out["partial_applied"] is True and out["rest_kept"] is True
        assert out["extra_loaded"] == {"calls": 7}
        assert 'Unexpected key(s) in state_dict: "nonsense"' in str(out["strict_error"])
