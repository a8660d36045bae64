"""Module-level tables in ``fsdp_core`` are read-only: no module holds a mutable container, and
every ``MappingProxyType`` table is found and refuses to change.
"""

from __future__ import annotations

import importlib
import pkgutil
from types import MappingProxyType
from typing import Any

import pytest

import fsdp_core
from fsdp_core import PLAN_BUILDERS, ShardingStrategy

# -- module-level tables are read-only ------------------------------------------------------


def _core_modules() -> list[Any]:
    """Every module of ``fsdp_core``, its subpackages' included."""
    found = pkgutil.walk_packages(fsdp_core.__path__, prefix="fsdp_core.")
    modules = [importlib.import_module(m.name) for m in found]
    assert len(modules) >= 20 and {"fsdp_core.plan.planner", "fsdp_core.sim.iteration"} <= {m.__name__ for m in modules}
    return modules


def _tables() -> dict[str, MappingProxyType[Any, Any]]:
    return {
        f"{module.__name__}.{name}": value
        for module in _core_modules()
        for name, value in vars(module).items()
        if isinstance(value, MappingProxyType)
    }


def test_no_mutable_module_level_container_in_core() -> None:
    mutable = [
        f"{module.__name__}.{name}"
        for module in _core_modules()
        for name, value in vars(module).items()
        if not name.startswith("__") and isinstance(value, (dict, list, set, bytearray))
    ]
    assert mutable == []


def test_the_tables_are_found() -> None:
    assert set(_tables()) >= {
        "fsdp_core.plan.planner.PLAN_BUILDERS",
        "fsdp_core.plan.planner._DTYPE_TAGS",
        "fsdp_core.sim.timeline._MARKS",
        "fsdp_core.unshard.verifier._USE",
    }


@pytest.mark.parametrize("name", sorted(_tables()))
def test_module_level_tables_refuse_mutation(name: str) -> None:
    table = _tables()[name]
    key = next(iter(table))
    with pytest.raises(TypeError):
        table[key] = table[key]  # type: ignore[index]
    with pytest.raises(TypeError):
        del table[key]  # type: ignore[attr-defined]
    with pytest.raises(AttributeError):
        table.clear()  # type: ignore[attr-defined]


def test_plan_builders_refuse_mutation() -> None:
    assert set(PLAN_BUILDERS) == set(ShardingStrategy)
    with pytest.raises(TypeError):
        PLAN_BUILDERS[ShardingStrategy.FULL_SHARD] = ()  # type: ignore[index]
    assert PLAN_BUILDERS is fsdp_core.PLAN_BUILDERS
