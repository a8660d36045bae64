"""``LiveBytes`` counts exactly the bytes of live tensor storages (single process, no group)."""

from __future__ import annotations

import torch

from fsdp_shell.memory import LiveBytes


def test_counts_storages_from_creation_to_death_once_each() -> None:
    with LiveBytes() as live:
        a = torch.ones(1000)
        assert live.current == 4000
        view = a[10:20].view(2, 5)
        assert live.current == 4000, "a view shares its base's storage"
        b = a.to(torch.bfloat16)
        assert live.current == 4000 + 2000
        del a
        assert live.current == 6000, "the view keeps the storage alive"
        del view
        assert live.current == 2000
        del b
        assert live.current == 0
        assert live.peak == 6000


def test_resizing_a_storage_is_seen_at_once() -> None:
    original = torch.UntypedStorage.resize_
    with LiveBytes() as live:
        t = torch.empty(256)
        storage = t.untyped_storage()
        storage.resize_(0)
        assert live.current == 0
        storage.resize_(512)
        assert (live.current, live.peak) == (512, 1024)
        del t, storage
        assert live.current == 0
    assert torch.UntypedStorage.resize_ is original, "the watch is undone on exit"


def test_each_phase_keeps_its_peak_and_tracks_what_was_there_before() -> None:
    before = torch.zeros(10)
    with LiveBytes() as live:
        live.track([before])
        assert live.current == 40
        with live.phase("forward"):
            x = torch.ones(100)
            y = x * 2
            del x
        with live.phase("backward"):
            z = y + 1
            del z
        del y
    assert live.peaks == {"other": 40, "forward": 840, "backward": 840}


def test_other_devices_are_not_counted() -> None:
    with LiveBytes() as live:
        meta = torch.empty(1 << 20, device="meta")
        assert live.current == 0
        del meta


def test_a_dtensor_counts_as_its_local_tensor_not_its_placeholder_storage() -> None:
    """A ``DTensor``'s own storage is a placeholder of the global size (no memory): what it holds is
    its local tensor's. One rank of a fake world of 4: 16 local floats of a 64-float tensor."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=1, world_size=4)
    try:
        mesh = init_device_mesh("cpu", (4,))
        with LiveBytes() as live:
            local = torch.zeros(4, 4)
            d = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
            doubled = d * 2  # a DTensor-level op: its result's local tensor is new
        assert d.untyped_storage().nbytes() == 256  # the placeholder
        assert live.current == 2 * 64 and isinstance(doubled, DTensor)
    finally:
        dist.destroy_process_group()
