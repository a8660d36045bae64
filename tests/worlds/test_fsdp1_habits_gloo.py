"""FSDP1 habits of training scripts, on gloo worlds of 2 and 4 (issue 17's list).

- ``clip_grad_norm_(float("inf"))``, the usual way to log the gradient norm: returns the total
  norm (the reference's) and changes no gradient;
- attribute fall-through: what the wrapper lacks is the wrapped module's (``model.config``, a
  submodule, a plain attribute), on the root and on nested units; a wrapped ``nn.Sequential``
  is subscriptable; the wrapper's own attributes still win; ``fsdp_modules``,
  ``check_is_root``, ``get_state_dict_type`` (torch's ``StateDictSettings``);
- a model built on the meta device: ``param_init_fn`` on rank 0 only plus
  ``sync_module_states`` trains like the reference; without ``param_init_fn``, ``to_empty`` and
  ``reset_parameters``; a meta module with neither is refused, naming it;
- ``summon_full_params`` with every option (writeback or not, ``rank0_only``, ``recurse=False``,
  ``with_grads``) and its refusals, flat and ``use_orig_params``; training goes on after it;
- ``model.apply(init_fn)`` on the full parameters; ``to`` the same device passes,
  ``to(torch.float64)`` is refused (the flat parameters are laid out at wrapping);
- ``torch.compile(wrapped)`` from the first call, the agreement check included.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable

import torch
from torch import nn
from torch.distributed.fsdp import StateDictType

from fsdp_shell import FSDP
from tests.worlds.dist_harness import run_world


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(4, 8)
        self.down = nn.Linear(8, 4)
        self.kind = "block"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down(torch.tanh(self.up(x)))
        return out


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.config = {"hidden": 4}
        self.blocks = nn.Sequential(Block(), Block())
        self.head = nn.Linear(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.blocks(x))
        return out


def _mine(x: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This rank's equal share of the batch ``x`` (its rows divide by the world: 2 or 4)."""
    rows = x.shape[0] // world
    return x[rows * rank : rows * (rank + 1)]


def habits(rank: int, world: int, _: None) -> dict[str, object]:
    out: dict[str, object] = {}
    torch.manual_seed(0)
    net = Net()
    ref = copy.deepcopy(net)
    model = FSDP(net, auto_wrap_policy={Block})
    x = torch.randn(12, 4, generator=torch.Generator().manual_seed(0))
    mine = _mine(x, rank, world)
    model(mine).square().mean().backward()
    ref(x).square().mean().backward()
    before = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    norm = model.clip_grad_norm_(float("inf"))
    after = [p.grad for p in model.parameters() if p.grad is not None]
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), float("inf"))
    out["norm_diff"] = float((norm - want).abs())
    out["grads_unchanged"] = len(before) > 0 and all(torch.equal(b, a) for b, a in zip(before, after))

    out["config"] = model.config
    out["blocks_is_inner"] = model.blocks is net.blocks
    first = model.blocks[0]
    out["nested_unit"] = isinstance(first, FSDP)
    out["nested_attr"] = first.kind
    out["nested_submodule"] = isinstance(first.up, nn.Linear)
    out["own_attr_wins"] = model.sharding_strategy.name
    try:
        model.no_such_thing  # noqa: B018
        out["missing"] = "found"
    except AttributeError as error:
        out["missing"] = str(error)

    seq = FSDP(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1)))
    out["indexed"] = [type(seq[i]).__name__ for i in range(3)]

    out["fsdp_modules"] = (len(FSDP.fsdp_modules(model)), len(FSDP.fsdp_modules(model, root_only=True)))
    out["is_root"] = (model.check_is_root(), first.check_is_root())
    before_type = FSDP.get_state_dict_type(model)
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        inside = FSDP.get_state_dict_type(model)
    out["state_dict_types"] = (
        before_type.state_dict_type.name,
        type(before_type.state_dict_config).__name__,
        inside.state_dict_type.name,
        type(inside.optim_state_dict_config).__name__,
    )
    return out


def check_habits(results: list[dict[str, object]]) -> None:
    for out in results:
        norm_diff = out["norm_diff"]
        assert isinstance(norm_diff, float) and norm_diff < 1e-6
        assert out["grads_unchanged"] is True
        assert out["config"] == {"hidden": 4}
        assert out["blocks_is_inner"] is True
        assert out["nested_unit"] is True and out["nested_attr"] == "block" and out["nested_submodule"] is True
        assert out["own_attr_wins"] == "FULL_SHARD"
        assert "no_such_thing" in str(out["missing"])
        assert out["indexed"] == ["Linear", "Tanh", "Linear"]
        assert out["fsdp_modules"] == (3, 1)
        assert out["is_root"] == (True, False)
        assert out["state_dict_types"] == (
            "FULL_STATE_DICT",
            "FullStateDictConfig",
            "SHARDED_STATE_DICT",
            "ShardedOptimStateDictConfig",
        )


def test_fsdp1_habits() -> None:
    check_habits(run_world(2, habits, None, timeout=120))


class Plain(nn.Module):
    """A module with a meta parameter and no ``reset_parameters``."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


def meta_init(rank: int, world: int, _: None) -> dict[str, object]:
    """Rank 0 loads real weights through ``param_init_fn``, rank 1 leaves them empty; with
    ``sync_module_states`` both train like the reference built on a real device."""
    out: dict[str, object] = {}
    torch.manual_seed(0)
    ref = Net()
    weights = dict(ref.named_modules())
    with torch.device("meta"):
        net = Net()
    names = {id(m): name for name, m in net.named_modules()}

    def init(m: nn.Module) -> None:
        m.to_empty(device="cpu", recurse=False)
        if rank == 0:
            with torch.no_grad():
                source = weights[names[id(m)]]
                for (_, p), (_, q) in zip(m.named_parameters(recurse=False), source.named_parameters(recurse=False)):
                    p.copy_(q)

    model = FSDP(net, auto_wrap_policy={Block}, param_init_fn=init, sync_module_states=True)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    x = torch.randn(12, 4, generator=torch.Generator().manual_seed(1))
    model(_mine(x, rank, world)).square().mean().backward()
    ref(x).square().mean().backward()
    opt.step(), ref_opt.step()
    got = model.full_state_dict()
    out["diff"] = max(float((got[k] - v).abs().max()) for k, v in ref.state_dict().items())

    with torch.device("meta"):
        default = Net()
    torch.manual_seed(0)
    plain = FSDP(default, auto_wrap_policy={Block})
    values = plain.full_state_dict()
    out["default_materialized"] = all(not v.is_meta and bool(torch.isfinite(v).all()) for v in values.values())
    out["default_initialized"] = float(values["head.weight"].abs().sum()) > 0

    with torch.device("meta"):
        bare = nn.Sequential(nn.Linear(4, 4), Plain())
    try:
        FSDP(bare)
        out["no_reset"] = "accepted"
    except ValueError as error:
        out["no_reset"] = str(error)
    try:
        FSDP(nn.Linear(2, 2), param_init_fn="zeros")  # type: ignore[arg-type]  # bad input on purpose
        out["not_callable"] = "accepted"
    except TypeError as error:
        out["not_callable"] = str(error)
    return out


def check_meta_init(results: list[dict[str, object]]) -> None:
    for out in results:
        diff = out["diff"]
        assert isinstance(diff, float) and diff < 1e-6
        assert out["default_materialized"] is True and out["default_initialized"] is True
        assert out["no_reset"] == (
            "module: 1 (Plain) is on the meta device and has no reset_parameters() to initialize it; "
            "pass param_init_fn=, or build it on a real device"
        )
        assert "param_init_fn: expected None or a callable(module), got 'zeros'" in str(out["not_callable"])


def test_meta_init_with_param_init_fn_and_sync_module_states() -> None:
    check_meta_init(run_world(2, meta_init, None, timeout=120))


def _resolve(model: nn.Module, name: str) -> torch.Tensor:
    """``model.<name>`` through the wrappers' attribute fall-through (``blocks.0.up.weight``)."""
    obj: object = model
    for part in name.split("."):
        obj = getattr(obj, part)
    assert isinstance(obj, torch.Tensor)
    return obj


def summon(rank: int, world: int, use_orig_params: bool) -> dict[str, object]:
    """``summon_full_params`` with each option, against a reference trained on all ranks' data."""
    out: dict[str, object] = {}
    torch.manual_seed(0)
    net = Net()
    ref = copy.deepcopy(net)
    model = FSDP(net, auto_wrap_policy={Block}, use_orig_params=use_orig_params)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    x = torch.randn(12, 4, generator=torch.Generator().manual_seed(2))
    model(_mine(x, rank, world)).square().mean().backward()
    ref(x).square().mean().backward()
    names = [n for n, _ in ref.named_parameters()]

    with FSDP.summon_full_params(model, writeback=False):
        out["full"] = max(float((_resolve(model, n) - p).detach().abs().max()) for n, p in ref.named_parameters())
        out["shapes"] = all(_resolve(model, n).shape == p.shape for n, p in ref.named_parameters())
    if use_orig_params:
        with FSDP.summon_full_params(model, with_grads=True, writeback=False):
            out["grads"] = max(
                float((_resolve(model, n).grad - p.grad).abs().max())  # type: ignore[operator]  # both have grads
                for n, p in ref.named_parameters()
            )
    opt.step(), ref_opt.step()
    opt.zero_grad(), ref_opt.zero_grad()

    with FSDP.summon_full_params(model), torch.no_grad():
        _resolve(model, "head.weight").add_(1.0)
        _resolve(model, "blocks.0.up.bias").mul_(2.0)
    with torch.no_grad():
        ref.head.weight.add_(1.0)
        first = ref.blocks[0]
        assert isinstance(first, Block)
        first.up.bias.mul_(2.0)
    with FSDP.summon_full_params(model, writeback=False), torch.no_grad():
        _resolve(model, "head.weight").zero_()
    got = model.full_state_dict()
    out["written_back"] = max(float((got[k] - v).abs().max()) for k, v in ref.state_dict().items())

    with FSDP.summon_full_params(model, rank0_only=True, writeback=False):
        out["rank0_only"] = [tuple(_resolve(model, n).shape) for n in names]
    with FSDP.summon_full_params(model, recurse=False, writeback=False):
        out["root_only"] = [tuple(_resolve(model, n).shape) for n in names]

    model(_mine(x, rank, world)).square().mean().backward()
    ref(x).square().mean().backward()
    opt.step(), ref_opt.step()
    got = model.full_state_dict()
    out["trains_after"] = max(float((got[k] - v).abs().max()) for k, v in ref.state_dict().items())

    calls: dict[str, Callable[[], contextlib.AbstractContextManager[None]]] = {
        "writeback-rank0_only": lambda: FSDP.summon_full_params(model, rank0_only=True),
        "with_grads": lambda: FSDP.summon_full_params(model, with_grads=True, writeback=False),
    }
    for name, call in calls.items():
        try:
            with call():
                pass
            out[name] = "accepted"
        except ValueError as error:
            out[name] = str(error)
    return out


def check_summon(use_orig_params: bool, results: list[dict[str, object]]) -> None:
    for rank, out in enumerate(results):
        for key in ("full", "written_back", "trains_after", *(("grads",) if use_orig_params else ())):
            value = out[key]
            assert isinstance(value, float) and value < 1e-6, (use_orig_params, key, value)
        assert out["shapes"] is True
        full = [(8, 4), (8,), (4, 8), (4,)] * 2 + [(1, 4), (1,)]
        rank0_only = out["rank0_only"]
        assert isinstance(rank0_only, list)
        if rank == 0:
            assert rank0_only == full
        elif use_orig_params:
            assert rank0_only != full, "rank0_only: rank 1 saw the full parameters"
        root_only = out["root_only"]
        assert isinstance(root_only, list) and root_only[-2:] == full[-2:]
        if use_orig_params:
            assert root_only[:-2] != full[:-2], "recurse=False gathered the nested units too"
        assert "writeback=True with rank0_only=True is not supported" in str(out["writeback-rank0_only"])
        assert (out["with_grads"] == "accepted") == use_orig_params, out["with_grads"]


def test_summon_full_params() -> None:
    for use_orig_params in (False, True):
        check_summon(use_orig_params, run_world(2, summon, use_orig_params, timeout=120))


def _init(m: nn.Module) -> None:
    if isinstance(m, nn.Linear):
        with torch.no_grad():
            m.weight.copy_(torch.arange(m.weight.numel(), dtype=torch.float32).view_as(m.weight).sin())
            nn.init.constant_(m.bias, 0.25)


def apply_and_to(rank: int, world: int, use_orig_params: bool) -> dict[str, object]:
    """``model.apply(init)`` initializes the full parameters as on the unwrapped model; ``to``
    the device it is on passes, ``to(torch.float64)`` is refused naming ``to``."""
    out: dict[str, object] = {}
    torch.manual_seed(0)
    net = Net()
    ref = copy.deepcopy(net)
    model = FSDP(net, auto_wrap_policy={Block}, use_orig_params=use_orig_params)
    out["returns_self"] = model.apply(_init) is model
    ref.apply(_init)
    got = model.full_state_dict()
    out["applied"] = max(float((got[k] - v).abs().max()) for k, v in ref.state_dict().items())
    out["same_device"] = model.to("cpu") is model
    try:
        model.to(torch.float64)
        out["to_dtype"] = "accepted"
    except ValueError as error:
        out["to_dtype"] = str(error)
    return out


def check_apply_and_to(results: list[dict[str, object]]) -> None:
    for out in results:
        applied = out["applied"]
        assert isinstance(applied, float) and applied == 0.0
        assert out["returns_self"] is True and out["same_device"] is True
        assert str(out["to_dtype"]).startswith("to: the parameters' dtype and device are fixed when FSDP wraps them")


def test_apply_runs_on_full_parameters_and_to_dtype_is_refused() -> None:
    for use_orig_params in (False, True):
        check_apply_and_to(run_world(2, apply_and_to, use_orig_params, timeout=120))


def compiled(rank: int, world: int, backend: str) -> dict[str, object]:
    """``torch.compile`` of the wrapped model from its first call: trains like the eager
    reference, Dynamo compiled graphs, and the cross-rank agreement still runs (a rank wrapped
    differently is refused under compile too)."""
    from torch._dynamo.utils import counters

    out: dict[str, object] = {}
    torch.manual_seed(0)
    net = Net()
    ref = copy.deepcopy(net)
    model = FSDP(net, auto_wrap_policy={Block})
    step = torch.compile(model, backend=backend)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    for i in range(3):
        x = torch.randn(12, 4, generator=torch.Generator().manual_seed(10 + i))
        step(_mine(x, rank, world)).square().mean().backward()
        ref(x).square().mean().backward()
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    got = model.full_state_dict()
    out["diff"] = max(float((got[k] - v).abs().max()) for k, v in ref.state_dict().items())
    out["graphs"] = int(counters["stats"]["unique_graphs"])

    other = FSDP(Net(), sharding_strategy="FULL_SHARD" if rank == 0 else "SHARD_GRAD_OP")
    try:
        torch.compile(other, backend=backend)(torch.randn(2, 4))
        out["mismatch"] = "accepted"
    except Exception as error:  # noqa: BLE001  (the type is what is checked)
        out["mismatch"] = type(error).__name__
    return out


def check_compiled(results: list[dict[str, object]]) -> None:
    for out in results:
        diff = out["diff"]
        assert isinstance(diff, float) and diff < 1e-5
        graphs = out["graphs"]
        assert isinstance(graphs, int) and graphs > 0
        assert out["mismatch"] == "RankMismatchError"


def test_torch_compile_of_the_wrapped_model_from_the_first_call() -> None:
    check_compiled(run_world(2, compiled, "inductor", timeout=600))


def on_four_ranks(rank: int, world: int, _: None) -> dict[str, dict[str, object]]:
    """The checks above in one world of 4 (one spawn): the habits, meta-device init, ``summon_full_params``
    and ``apply``/``to`` flat and ``use_orig_params``, ``torch.compile`` (``aot_eager``: Dynamo
    and AOTAutograd as under inductor, without four ranks compiling C++ on two cores)."""
    return {
        "habits": habits(rank, world, None),
        "meta": meta_init(rank, world, None),
        "summon-flat": summon(rank, world, False),
        "summon-orig": summon(rank, world, True),
        "apply-flat": apply_and_to(rank, world, False),
        "apply-orig": apply_and_to(rank, world, True),
        "compile": compiled(rank, world, "aot_eager"),
    }


def test_the_habits_on_four_ranks() -> None:
    results = run_world(4, on_four_ranks, None, timeout=600)
    check_habits([out["habits"] for out in results])
    check_meta_init([out["meta"] for out in results])
    check_summon(False, [out["summon-flat"] for out in results])
    check_summon(True, [out["summon-orig"] for out in results])
    check_apply_and_to([out["apply-flat"] for out in results] + [out["apply-orig"] for out in results])
    check_compiled([out["compile"] for out in results])
