"""``fsdp_shell.fully_shard``'s API without communicating: under torch's fake process group (one
process plays one rank, nothing is sent), what it makes of a module (its class, DTensor
parameters placed as PyTorch's FSDP2 places them, which parameters each call manages) and what
it refuses, by name. Training is checked against PyTorch's own on real ranks in
``tests/worlds/test_fully_shard_gloo.py``."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore

from fsdp_shell import FSDPModule, fully_shard, register_fsdp_forward_method
from fsdp_shell.fsdp2.state import state_of


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(6, 9)
        self.down = nn.Linear(9, 6, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down(torch.relu(self.up(x)))
        return out


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(6, 3)


@pytest.fixture
def world() -> Iterator[None]:
    """This process is rank 1 of a fake world of 4; torn down after the test."""
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
    yield
    dist.destroy_process_group()


def test_the_module_becomes_an_fsdp_module_of_its_class_placed_as_fsdp2_places_it(world: None) -> None:
    torch.manual_seed(0)
    ours, theirs = Net(), Net()
    theirs.load_state_dict(ours.state_dict())
    for b in ours.blocks:
        assert cast(object, fully_shard(b)) is b
    fully_shard(ours)
    for b in theirs.blocks:
        torch_fully_shard(b)
    torch_fully_shard(theirs)
    assert isinstance(ours, FSDPModule) and isinstance(ours, Net) and type(ours).__name__ == "FSDPNet"
    assert type(ours.blocks[0]) is type(ours.blocks[1])  # one FSDPBlock class for every Block
    assert not isinstance(ours.head, FSDPModule)
    mine, fsdp2 = dict(ours.named_parameters()), dict(theirs.named_parameters())
    assert list(mine) == list(fsdp2)
    for name, p in mine.items():
        q = fsdp2[name]
        assert isinstance(p, DTensor) and isinstance(q, DTensor) and isinstance(p, nn.Parameter)
        assert (p.placements, p.shape, p.to_local().shape) == (q.placements, q.shape, q.to_local().shape), name
        assert torch.equal(p.to_local(), q.to_local()), name
    up = mine["blocks.0.up.weight"]
    assert isinstance(up, DTensor) and up.to_local().shape == (3, 6)  # rows 3-5 of 9 on rank 1
    root, block = state_of(ours), state_of(ours.blocks[0])
    assert root is not None and root.group is not None and block is not None and block.group is not None
    assert [p.name for p in root.group.layout.params] == ["head.weight", "head.bias"]  # nested calls own the rest
    assert [p.name for p in block.group.layout.params] == ["up.weight", "up.bias", "down.weight"]


def test_a_2d_mesh_places_replicate_then_shard_and_ignored_parameters_stay_plain(world: None) -> None:
    model = Block()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    ignored = {cast(nn.Parameter, model.down.weight)}
    fully_shard(model, mesh=mesh, ignored_params=ignored, shard_placement_fn=lambda p: Shard(1))
    up = model.up.weight
    assert isinstance(up, DTensor) and up.placements == (Replicate(), Shard(1)) and up.to_local().shape == (9, 3)
    assert not isinstance(model.down.weight, DTensor) and model.down.weight.shape == (6, 9)


def test_an_int_reshard_after_forward_is_a_group_size_one_and_the_shard_groups_are_bools(world: None) -> None:
    sizes, meshes = {}, []
    for n in (1, 2, 4, 2):
        model = Block()
        fully_shard(model, reshard_after_forward=n)
        state = state_of(model)
        assert state is not None
        small = state.post_forward_mesh
        sizes[n] = (state.settings.reshard_after_forward, None if small is None else small.mesh.tolist())
        meshes.append(small)
    assert sizes == {1: (False, None), 2: (2, [0, 1]), 4: (True, None)}  # rank 1's group: ranks 0 and 1
    assert meshes[1] is meshes[3]  # made once for the mesh and size


def test_tensor_parallel_parameters_must_be_on_a_1d_part_of_the_same_mesh(world: None) -> None:
    from torch.distributed.tensor import distribute_tensor

    world_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = Block()
    model.up.weight = nn.Parameter(distribute_tensor(model.up.weight.detach(), world_mesh["tp"], [Shard(0)]))
    fully_shard(model, mesh=world_mesh["dp"])
    up = model.up.weight
    assert isinstance(up, DTensor) and up.device_mesh.mesh_dim_names == ("dp", "tp")
    assert up.to_local().shape == (2, 6)  # rank 1 (dp 0, tp 1): rows 5-8 of 9 for tp 1, the first 2 for dp 0
    two_d = Block()
    two_d.up.weight = nn.Parameter(distribute_tensor(two_d.up.weight.detach(), world_mesh, [Shard(0), Shard(1)]))
    with pytest.raises(NotImplementedError, match=r"^module: parameter 'up.weight' is a DTensor on a 2-D mesh"):
        fully_shard(two_d, mesh=world_mesh["dp"])
    elsewhere = Block()  # on the dp dimension itself
    elsewhere.up.weight = nn.Parameter(distribute_tensor(elsewhere.up.weight.detach(), world_mesh["dp"], [Shard(0)]))
    with pytest.raises(ValueError, match=r"^mesh: parameter 'up.weight' is a DTensor on a mesh that is not another"):
        fully_shard(elsewhere, mesh=world_mesh["dp"])


def test_frozen_parameters_are_sharded_but_only_trainable_ones_are_reduced(world: None) -> None:
    model = Block()
    model.up.requires_grad_(False)
    fully_shard(model)
    state = state_of(model)
    assert state is not None and state.group is not None and state.group.reduce_layout is not None
    assert [p.name for p in state.group.reduce_layout.params] == ["down.weight"]
    assert isinstance(model.up.weight, DTensor) and not model.up.weight.requires_grad


@pytest.mark.parametrize(
    ("kwargs", "error", "says"),
    [
        ({"reshard_after_forward": 3}, ValueError, "reshard_after_forward: an int is the size of the groups"),
        ({"reshard_after_forward": 0}, ValueError, "reshard_after_forward: an int is the size of the groups"),
        ({"reshard_after_forward": "yes"}, TypeError, "reshard_after_forward: expected None, a bool"),
        ({"offload_policy": CPUOffloadPolicy()}, ValueError, "offload_policy: pin_memory=True pins for an"),
        ({"mp_policy": "bf16"}, TypeError, "mp_policy: expected torch.distributed.fsdp.MixedPrecisionPolicy"),
        ({"mesh": "cpu"}, TypeError, "mesh: expected a DeviceMesh"),
        ({"shard_placement_fn": lambda p: Replicate()}, TypeError, "shard_placement_fn: expected Shard"),
    ],
)
def test_fully_shard_refuses_what_it_does_not_support_by_argument(
    world: None, kwargs: dict[str, Any], error: type[Exception], says: str
) -> None:
    with pytest.raises(error, match=f"^{re.escape(says)}"):
        fully_shard(Block(), **kwargs)


def test_other_refusals_name_the_argument(world: None) -> None:
    with pytest.raises(ValueError, match=r"^mesh: expected a 1-D"):
        fully_shard(Block(), mesh=init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("a", "b", "c")))
    model = Block()
    fully_shard(model)
    with pytest.raises(ValueError, match=r"^module: fully_shard was already applied to FSDPBlock"):
        fully_shard(model)
    mixed = Block()
    mixed.down.to(torch.float64)
    with pytest.raises(ValueError, match=r"^module: the parameters of one fully_shard call must share one dtype"):
        fully_shard(mixed)
    with pytest.raises(TypeError, match=r"^module: expected an nn.Module"):
        fully_shard([])
    with torch.device("meta"):
        on_meta = Block()
    fully_shard(on_meta)  # shapes only, until to_empty
    with pytest.raises(RuntimeError, match=r"^module: parameter 'up.weight' is still on the meta device at the first"):
        on_meta(torch.randn(2, 6))
    with pytest.raises(ValueError, match=r"^params\['up.weight'\]: dimension 1 of size 6 does not divide over 4"):
        fully_shard(Block(), shard_placement_fn=lambda p: Shard(1))


@pytest.mark.parametrize(
    ("method", "args"),
    [
        ("set_custom_all_gather", (None,)),
        ("set_custom_reduce_scatter", (None,)),
        ("set_reduce_scatter_unused_params", (False,)),
    ],
)
def test_unsupported_methods_raise_naming_themselves(world: None, method: str, args: tuple[object, ...]) -> None:
    model = fully_shard(Block())
    with pytest.raises(NotImplementedError, match=f"{method}: "):
        getattr(model, method)(*args)


def test_a_post_optim_event_is_an_event_kept_for_the_roots_next_forward_only(world: None) -> None:
    model = fully_shard(Block())
    with pytest.raises(TypeError, match=r"^event: expected a torch.Event"):
        model.set_post_optim_event(None)  # type: ignore[arg-type]  # a bad value on purpose
    event = torch.Event(device="cpu")
    model.set_post_optim_event(event)
    state = state_of(cast(nn.Module, model))
    assert state is not None and state.post_optim_event is event
    cast(nn.Module, model)(torch.randn(2, 6))  # the fake world communicates nothing
    assert state.post_optim_event is None


def test_set_all_reduce_hook_refuses_a_non_callable_and_a_stream(world: None) -> None:
    model = fully_shard(Block())
    with pytest.raises(TypeError, match=r"^hook: expected a callable"):
        model.set_all_reduce_hook(3)  # type: ignore[arg-type]  # a bad value on purpose
    with pytest.raises(NotImplementedError, match=r"^set_all_reduce_hook: stream \(a stream of the caller's"):
        model.set_all_reduce_hook(print, stream=object())


def test_the_setters_check_and_record_their_values(world: None) -> None:
    net = Net()
    for b in net.blocks:
        fully_shard(b)
    model = fully_shard(net)
    model.set_requires_gradient_sync(False)
    model.set_reshard_after_backward(False, recurse=False)
    model.set_gradient_divide_factor(8)
    model.set_reduce_scatter_unused_params(True)
    root, block = state_of(net), state_of(net.blocks[0])
    assert root is not None and block is not None
    assert (root.settings.requires_gradient_sync, block.settings.requires_gradient_sync) == (False, False)
    assert (root.settings.reshard_after_backward, block.settings.reshard_after_backward) == (False, True)
    assert (root.settings.gradient_divide_factor, block.settings.gradient_divide_factor) == (8.0, None)
    with pytest.raises(TypeError, match=r"^requires_gradient_sync: expected a bool"):
        model.set_requires_gradient_sync(1)  # type: ignore[arg-type]  # a bad value on purpose
    with pytest.raises(ValueError, match=r"^factor: expected a number > 0"):
        model.set_gradient_divide_factor(0)
    with pytest.raises(ValueError, match=r"^method_name: FSDPNet has no method 'generate'"):
        register_fsdp_forward_method(net, "generate")
    with pytest.raises(ValueError, match=r"^module: expected a module fully_shard was applied to"):
        register_fsdp_forward_method(nn.Linear(2, 2), "forward")


def test_without_a_process_group_it_says_so() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    with pytest.raises(RuntimeError, match="init_process_group"):
        fully_shard(Block())


def test_mixed_precision_policy_is_torchs(world: None) -> None:
    model = Block()
    fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    state = state_of(model)
    assert state is not None and state.group is not None
    assert (state.group.dtypes.compute, state.group.dtypes.reduce) == (torch.bfloat16, torch.bfloat16)
