"""``torch.distributed.checkpoint.state_dict.get_state_dict`` / ``set_state_dict`` with
``dcp.save`` / ``dcp.load`` on wrapped models, as torchtitan-style scripts checkpoint (issue 17).

Each configuration trains a wrapped model with AdamW for two steps, checkpoints model and
optimizer through ``get_state_dict`` + ``dcp.save``, trains two more steps, then builds a
differently initialized model, loads the checkpoint through ``dcp.load`` + ``set_state_dict`` and
trains the same two steps: the losses equal the first run's bit for bit, and the first run's
losses equal a single-process reference's (the unwrapped model on the whole batch). Full and
sharded state dicts, flat and ``use_orig_params``, on 2 ranks; hybrid sharding on 4 ranks,
whose sharded checkpoint a 2-rank ``FULL_SHARD`` world then resumes (another world size and
strategy). ``broadcast_from_rank0`` loads rank 0's full state dict everywhere,
``ignore_frozen_params`` drops frozen parameters (a frozen unit; a frozen parameter beside
trainable ones with ``use_orig_params``); options this path cannot honour are refused by name; a
model without our wrapper still gets torch's own path.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.device_mesh import init_device_mesh

from fsdp_shell import FSDP
from tests.worlds.dist_harness import run_world

STEPS = 4
SAVED_AT = 2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(6, 12)
        self.down = nn.Linear(12, 6)
        self.register_buffer("gain", torch.ones(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = x + self.down(torch.tanh(self.up(x))) * self.gain
        return out


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(3, 6)
        self.blocks = nn.Sequential(Block(), Block())
        self.head = nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.head(self.blocks(self.embed(x)))
        return out


@dataclass(frozen=True)
class Config:
    directory: str
    full: bool
    use_orig_params: bool
    hybrid: bool = False

    @property
    def options(self) -> StateDictOptions:
        return StateDictOptions(full_state_dict=self.full)


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 3, generator=g), torch.randn(8, 1, generator=g)


def _wrap(seed: int, cfg: Config, world: int) -> tuple[FSDP, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    kwargs: dict[str, object] = {}
    if cfg.hybrid:
        kwargs = {
            "sharding_strategy": "HYBRID_SHARD",
            "device_mesh": init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("replicate", "shard")),
        }
    model = FSDP(Net(), auto_wrap_policy={Block}, use_orig_params=cfg.use_orig_params, **kwargs)  # type: ignore[arg-type]  # keyword arguments of several types
    return model, torch.optim.AdamW(model.parameters(), lr=0.05)


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: range, rank: int, world: int) -> list[float]:
    losses = []
    per = 8 // world
    for step in steps:
        x, y = _batch(step)
        loss = (model(x[rank * per : (rank + 1) * per]) - y[rank * per : (rank + 1) * per]).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total) / world)
    return losses


def _reference() -> list[float]:
    torch.manual_seed(0)
    ref = Net()
    opt = torch.optim.AdamW(ref.parameters(), lr=0.05)
    losses = []
    for step in range(STEPS):
        x, y = _batch(step)
        loss = (ref(x) - y).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss))
    return losses


def save_and_resume(rank: int, world: int, configs: tuple[Config, ...]) -> dict[str, object]:
    out: dict[str, object] = {"reference": _reference()}
    for cfg in configs:
        model, opt = _wrap(0, cfg, world)
        first = _train(model, opt, range(SAVED_AT), rank, world)
        msd, osd = get_state_dict(model, opt, options=cfg.options)
        kinds = sorted({type(v).__name__ for v in msd.values()})
        dcp_save({"model": msd, "optim": osd}, checkpoint_id=cfg.directory)
        rest = _train(model, opt, range(SAVED_AT, STEPS), rank, world)

        fresh, fresh_opt = _wrap(1, cfg, world)
        msd2, osd2 = get_state_dict(fresh, fresh_opt, options=cfg.options)
        dcp_load({"model": msd2, "optim": osd2}, checkpoint_id=cfg.directory)
        set_state_dict(fresh, fresh_opt, model_state_dict=msd2, optim_state_dict=osd2, options=cfg.options)
        resumed = _train(fresh, fresh_opt, range(SAVED_AT, STEPS), rank, world)
        out[cfg.directory] = {
            "losses": first + rest,
            "resumed": resumed,
            "kinds": kinds,
            "keys": sorted(msd),
            "optim_keys": sorted(osd["state"]),  # type: ignore[type-var]  # "state" holds a dict
        }
    return out


def resume_elsewhere(rank: int, world: int, cfg: Config) -> list[float]:
    """Load a checkpoint another world (size and strategy) saved and train on from it."""
    model, opt = _wrap(1, cfg, world)
    msd, osd = get_state_dict(model, opt, options=cfg.options)
    dcp_load({"model": msd, "optim": osd}, checkpoint_id=cfg.directory)
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd, options=cfg.options)
    return _train(model, opt, range(SAVED_AT, STEPS), rank, world)


def _check(out: dict[str, object], cfg: Config) -> list[float]:
    got = out[cfg.directory]
    assert isinstance(got, dict)
    assert got["resumed"] == got["losses"][SAVED_AT:], cfg
    assert got["losses"] == pytest.approx(out["reference"], rel=1e-5, abs=1e-6), cfg
    assert got["kinds"] == (["Tensor"] if cfg.full else ["DTensor", "Tensor"]), cfg
    params = ["embed.weight", "embed.bias", "head.weight", "head.bias"]
    params += [f"blocks.{i}.{lin}.{w}" for i in (0, 1) for lin in ("up", "down") for w in ("weight", "bias")]
    assert got["keys"] == sorted([*params, "blocks.0.gain", "blocks.1.gain"]), cfg
    assert got["optim_keys"] == sorted(params), cfg
    losses: list[float] = got["losses"]
    return losses


def test_get_and_set_state_dict_with_dcp_on_2_ranks(tmp_path: Path) -> None:
    configs = tuple(
        Config(str(tmp_path / f"{full}-{orig}"), full=full, use_orig_params=orig)
        for full in (True, False)
        for orig in (False, True)
    )
    for out in run_world(2, save_and_resume, configs, timeout=240):
        for cfg in configs:
            _check(out, cfg)


def test_a_hybrid_checkpoint_resumes_on_another_world_size(tmp_path: Path) -> None:
    hybrid = Config(str(tmp_path / "hybrid"), full=False, use_orig_params=False, hybrid=True)
    (out, *_) = run_world(4, save_and_resume, (hybrid,), timeout=240)
    losses = _check(out, hybrid)
    elsewhere = Config(hybrid.directory, full=False, use_orig_params=True)
    for resumed in run_world(2, resume_elsewhere, elsewhere, timeout=240):
        assert resumed == pytest.approx(losses[SAVED_AT:], rel=1e-5, abs=1e-6)


def broadcast(rank: int, world: int, _: None) -> dict[str, object]:
    out: dict[str, object] = {}
    torch.manual_seed(0)
    ref = Net()
    model, _opt = _wrap(1, Config("", full=True, use_orig_params=True), world)
    given = ref.state_dict() if rank == 0 else {}
    set_model_state_dict(model, given, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    mine = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    out["equal"] = sorted(mine) == sorted(ref.state_dict()) and all(
        torch.equal(mine[k], v)  # type: ignore[arg-type]  # full state dicts hold tensors
        for k, v in ref.state_dict().items()
    )
    offloaded = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    out["offloaded"] = len(offloaded)
    for name, options in (
        ("flatten", StateDictOptions(flatten_optimizer_state_dict=True)),
        ("submodules", None),
    ):
        try:
            if options is None:
                get_model_state_dict(model, submodules={model.head})
            else:
                get_state_dict(model, _opt, options=options)
            out[name] = "accepted"
        except ValueError as error:
            out[name] = str(error)
    plain = Net()
    out["plain"] = sorted(get_model_state_dict(plain)) == sorted(plain.state_dict())
    for use_orig_params in (False, True):
        frozen, _frozen_opt = _wrap(0, Config("", full=True, use_orig_params=use_orig_params), world)
        frozen.blocks[1].requires_grad_(False)
        if use_orig_params:
            frozen.head.weight.requires_grad_(False)
        kept = get_model_state_dict(frozen, options=StateDictOptions(full_state_dict=True, ignore_frozen_params=True))
        out[f"frozen dropped {use_orig_params}"] = sorted(set(ref.state_dict()) - set(kept))
    return out


def test_broadcast_from_rank0_refusals_and_plain_models() -> None:
    outs = run_world(2, broadcast, None, timeout=120)
    for rank, out in enumerate(outs):
        assert out["equal"] is True
        assert out["offloaded"] == (14 if rank == 0 else 0)
        assert "flatten_optimizer_state_dict" in str(out["flatten"])
        assert "submodules" in str(out["submodules"])
        assert out["plain"] is True
        block = ["blocks.1.down.bias", "blocks.1.down.weight", "blocks.1.up.bias", "blocks.1.up.weight"]
        assert out["frozen dropped False"] == block
        assert out["frozen dropped True"] == sorted([*block, "head.weight"])
