"""Ranks agree before the first collective: the verifier's promise carried across ranks.

At the root's first forward every rank describes what must be the same everywhere (strategy,
group sizes, the unit tree with every parameter's name, shape and dtype, mixed precision,
offload, comm hook, division, prefetch, and each unit's plan request) and how its groups are
made; one small all-gather of a digest and the group ranks compares them. On a mismatch every
rank gathers the descriptions and raises the same ``RankMismatchError`` naming the first field
that differs and each rank's value, so no mismatched collective is ever issued.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist

from fsdp_core import Event, HookEvent
from fsdp_shell.runtime.collectives import all_gather_flat, all_gather_objects, release

if TYPE_CHECKING:
    from fsdp_shell.tree import Tree

__all__ = ["RankMismatchError", "check_agreement", "check_same_events", "describe"]

Field = tuple[str, str]


class RankMismatchError(RuntimeError):
    """Ranks were built differently; raised identically on every rank."""


def describe(tree: Tree) -> tuple[Field, ...]:
    """What must agree across ranks, as (field, value) pairs in a fixed order."""
    o, s = tree.options, tree.settings
    fields: list[Field] = [
        ("sharding_strategy", o.strategy.name),
        ("shard group size", str(tree.groups.shard_size)),
        ("replicate group size", str(tree.groups.replicate_size)),
        ("use_orig_params", str(o.use_orig_params)),
        ("mixed_precision", repr(o.mixed_precision)),
        ("cpu_offload", repr(o.offload)),
        ("comm hook", s.comm_hook_kind.value),
        ("division", repr(s.division)),
        ("hybrid_all_reduce", o.hybrid_all_reduce.value),
        ("backward_prefetch", str(o.backward_prefetch)),
        ("forward_prefetch", str(o.forward_prefetch)),
        ("ranks_may_diverge", str(o.ranks_may_diverge)),
        ("number of FSDP units", str(len(tree.handles))),
    ]
    for index, h in enumerate(tree.handles):
        if h is None:
            fields.append((f"unit {index}", "no parameters"))
            continue
        params = ", ".join(f"{p.name}{list(p.shape)}" for p in h.layout.params)
        fields.append(
            (f"unit {index} parameters", f"{params} ({h.orig_dtype}, requires_grad {h.flat_param.requires_grad})")
        )
        request = tree.settings.request(h.request)
        request = dataclasses.replace(request, sharding=dataclasses.replace(request.sharding, rank=0))
        fields.append((f"unit {index} plan request", hashlib.sha256(repr(request).encode()).hexdigest()[:16]))
    return tuple(fields)


def check_agreement(tree: Tree) -> float:
    """Compare this rank's description with every other rank's (a collective); raise
    ``RankMismatchError`` on every rank if they differ. Returns the seconds the comparison took
    (not counting the control group's creation the first time)."""
    group = tree.control
    start = time.perf_counter()
    fields = describe(tree)
    digest = hashlib.sha256(repr(fields).encode()).hexdigest()
    shard = dist.get_process_group_ranks(tree.groups.shard)
    replicate = dist.get_process_group_ranks(tree.groups.replicate) if tree.groups.replicate is not None else []
    seen = cast(
        list[tuple[int, str, list[int], list[int]]],
        all_gather_objects((dist.get_rank(), digest, shard, replicate), group),
    )
    if len({d for _, d, _, _ in seen}) > 1:
        details = cast(list[tuple[int, tuple[Field, ...]]], all_gather_objects((dist.get_rank(), fields), group))
        raise RankMismatchError(_first_difference(details))
    _check_partition(seen)
    return time.perf_counter() - start


def _first_difference(details: list[tuple[int, tuple[Field, ...]]]) -> str:
    longest = max(len(f) for _, f in details)
    for i in range(longest):
        values = {rank: (f[i] if i < len(f) else ("(nothing)", "(nothing)")) for rank, f in details}
        if len(set(values.values())) > 1:
            name = next(v[0] for v in values.values() if v[0] != "(nothing)")
            shown = "; ".join(
                f"rank {rank}: {_short(v[1] if v[0] == name else f'{v[0]} = {v[1]}')}"
                for rank, v in sorted(values.items())
            )
            return (
                f"FSDP: ranks disagree on {name} (checked before the first collective): {shown}. "
                "Build the model and FSDP with the same arguments on every rank"
            )
    return "FSDP: ranks disagree (descriptions differ but no field does)"


def _short(text: str, limit: int = 160) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _check_partition(seen: list[tuple[int, str, list[int], list[int]]]) -> None:
    """Every rank's shard (replicate) group must be the one each of its members reports."""
    by_rank = {rank: (shard, replicate) for rank, _, shard, replicate in seen}
    for rank, (shard, replicate) in sorted(by_rank.items()):
        for which, ranks, slot in (("shard", shard, 0), ("replicate", replicate, 1)):
            for member in ranks:
                theirs = by_rank.get(member)
                if theirs is not None and theirs[slot] != ranks:
                    raise RankMismatchError(
                        f"FSDP: process_group: rank {rank}'s {which} group is {ranks} but rank {member}'s is "
                        f"{theirs[slot]}; every rank must pass groups from one layout (e.g. one DeviceMesh)"
                    )


def check_same_events(tree: Tree, events: list[HookEvent]) -> None:
    """At the end of a backward: every rank ran the same FSDP events (pre-forward of each unit,
    pre- and post-backward, the ends), compared by digest with one tiny all-gather. If not, the
    ranks' collectives may have been paired wrongly, so every rank raises (the step's gradients
    must not reach the optimizer)."""
    group = tree.control
    size = dist.get_world_size(group)
    if size == 1:
        return
    digest = int.from_bytes(hashlib.sha256(repr(events).encode()).digest()[:7], "little")
    local = torch.tensor([digest], dtype=torch.int64)
    gathered = torch.empty(size, dtype=torch.int64)
    all_gather_flat(gathered, local, group)
    digests = gathered.tolist()
    release(local, gathered)
    if len(set(digests)) == 1:
        return
    details = cast(list[tuple[int, list[HookEvent]]], all_gather_objects((dist.get_rank(), events), group))
    shown = "; ".join(f"rank {rank}: units {_units(e)}" for rank, e in sorted(details))
    raise RankMismatchError(
        "FSDP: ranks ran different FSDP units in this iteration (their collectives may have been paired "
        f"wrongly, so this backward's gradients must not be used): {shown}. Pass ranks_may_diverge=True "
        "when ranks' models can skip a wrapped module or leave its output unused"
    )


def _units(events: list[HookEvent]) -> str:
    forward = [u for e, u in events if e is Event.PRE_FORWARD]
    backward = [u for e, u in events if e is Event.POST_BACKWARD]
    return f"forward {forward}, reduced {backward}"
