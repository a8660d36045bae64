"""Every public name of torch's FSDP1 class is in the user guide's table, and the table is true.

The names: the methods and properties FSDP1's class defines itself, the attributes an FSDP1
instance has (made on a gloo world of 1), its constructor's keywords, and its ``__getattr__`` /
``__getitem__``. Each must have a row in ``docs/user-guide.md``'s "FSDP1's public names". Each
row says how ours stands: a constructor keyword that works is one of our constructor's; a
method, static method or attribute that works is defined by our class (not inherited from
``nn.Module``) and, for attributes, read without error on a wrapped model; a refused one raises
``NotImplementedError`` at the call, naming the replacement the row names.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

from fsdp_shell import FSDP
from tests.worlds.dist_harness import run_world

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "user-guide.md"
ROW = re.compile(r"^\| `(?P<name>[^`]+)` \| (?P<kind>\w+) \| (?P<here>works|refused) \|(?P<notes>.*)\|$")


def _table() -> dict[tuple[str, str], tuple[str, str]]:
    text = GUIDE.read_text(encoding="utf-8")
    section = text.split("### FSDP1's public names", 1)[1].split("\n\n| Name |", 1)[1].split("\n\n", 1)[0]
    rows = {}
    for line in section.splitlines():
        match = ROW.match(line)
        if match:
            rows[(match["name"], match["kind"])] = (match["here"], match["notes"])
    return rows


def instance_names(rank: int, world: int, _: None) -> dict[str, object]:
    theirs = TorchFSDP(nn.Linear(2, 2), device_id=torch.device("cpu"))
    plain = nn.Linear(2, 2)
    attributes = sorted(n for n in vars(theirs) if not n.startswith("_") and n not in vars(plain))
    ours = FSDP(nn.Linear(2, 2))
    read = {}
    for name in [*attributes, "module"]:
        try:
            getattr(ours, name)
            read[name] = "ok"
        except Exception as error:  # noqa: BLE001  (reported by the test)
            read[name] = repr(error)
    return {"attributes": attributes, "read": read}


@pytest.fixture(scope="module")
def instance() -> dict[str, object]:
    (out,) = run_world(1, instance_names, None, timeout=120)
    return out


def _torch_names(instance: dict[str, object]) -> dict[str, set[str]]:
    methods = {n for n in vars(TorchFSDP) if not n.startswith("_")} | {"__getattr__", "__getitem__"}
    constructor = set(inspect.signature(TorchFSDP.__init__).parameters) - {"self"}
    attributes = instance["attributes"]
    assert isinstance(attributes, list)
    return {"methods": methods, "constructor": constructor, "attributes": set(attributes)}


def test_every_fsdp1_name_has_a_row(instance: dict[str, object]) -> None:
    rows = _table()
    names = _torch_names(instance)
    assert len(names["methods"]) >= 20 and len(names["constructor"]) >= 16 and len(names["attributes"]) >= 10
    have = {name for name, _ in rows}
    missing = sorted((names["methods"] | names["constructor"] | names["attributes"]) - have)
    assert missing == [], f"FSDP1 names without a row in the user guide: {missing}"
    for name in names["constructor"]:
        assert (name, "constructor") in rows, name
    for name in names["attributes"]:
        assert (name, "attribute") in rows or (name, "method") in rows, name


def test_every_row_is_true(instance: dict[str, object]) -> None:
    ours = set(inspect.signature(FSDP.__init__).parameters)
    read = instance["read"]
    assert isinstance(read, dict)
    own = {n for cls in FSDP.__mro__ if cls is not nn.Module and cls is not object for n in vars(cls)}
    for (name, kind), (here, notes) in _table().items():
        if kind == "constructor":
            assert here == "works" and name in ours, name
            continue
        assert name in own, f"{name}: not defined by FullyShardedDataParallel itself"
        if kind == "attribute":
            assert read.get(name) == "ok", (name, read.get(name))
        if here == "refused":
            replacement = re.findall(r"`([^`]+)`", notes)[0]
            with pytest.raises(NotImplementedError, match=re.escape(replacement)):
                getattr(FSDP, name)()
