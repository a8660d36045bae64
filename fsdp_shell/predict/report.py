"""A prediction for people (``format_prediction``) and for programs (``prediction_to_json``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from fsdp_core import HookEvent
from fsdp_core.memory import Category, Mark, ModelMemory, PhasePeak, UnitSpec
from fsdp_core.problems import JsonValue
from fsdp_core.sim import IterationTimeline, describe_cost
from fsdp_shell.predict.model import Prediction, StepTime

__all__ = ["format_prediction", "format_step_time", "prediction_to_json", "step_time_to_json"]

_UNITS = (("B", 1), ("KiB", 2**10), ("MiB", 2**20), ("GiB", 2**30))


def _unit_for(nbytes: int) -> tuple[str, int]:
    """The largest unit in which ``nbytes`` is at least 10."""
    name, size = _UNITS[0]
    for candidate, scale in _UNITS:
        if nbytes >= 10 * scale:
            name, size = candidate, scale
    return name, size


_COLUMNS: tuple[tuple[Category, str, str], ...] = (
    (Category.PARAMS_SHARDED, "params", "sharded"),
    (Category.PARAMS_UNSHARDED, "params", "unsharded"),
    (Category.GRADS_CARRIED, "grads", "carried"),
    (Category.REDUCE, "reduce", ""),
    (Category.OPTIMIZER_STATE, "optimizer", "state"),
    (Category.OPTIMIZER_STEP, "optimizer", "step"),
    (Category.AUTOGRAD, "autograd", ""),
    (Category.BUFFERS, "buffers", ""),
    (Category.WORKSPACE, "workspace", ""),
)


def _where(p: Prediction, at: HookEvent | Mark | None) -> str:
    """Where a peak was reached, for people."""
    if at is None:
        return "optimizer.step()"
    if isinstance(at, Mark):
        return at.value.replace("_", " ")
    event, unit = at
    name = event.value.replace("_", "-")
    if unit < 0:
        return name
    path = p.paths[unit]
    return f"{name} of unit {unit} ({path or 'the root'})"


def _unsharded_bytes(u: UnitSpec) -> int:
    return u.request.padded_numel * u.request.compute_dtype.itemsize


def _units_table(p: Prediction) -> list[str]:
    biggest = max(u.request.padded_numel * u.request.compute_dtype.itemsize for u in p.units if u)
    name, scale = _unit_for(biggest)
    lines = [f"  {'unit':>4}  {'module':<28} {'parameters':>14} {'shard elements':>15} {'unsharded ' + name:>14}"]
    previous: tuple[int, int, int] | None = None
    repeated: list[int] = []

    def flush() -> None:
        if len(repeated) > 1:
            which = f"unit {repeated[1]}" if len(repeated) == 2 else f"units {repeated[1]}-{repeated[-1]}"
            lines.append(f"  {'':>4}  ... {which} the same")

    for index, u in enumerate(p.units):
        if u is None:
            continue
        r = u.request
        row = (r.layout.numel_without_padding, r.shard_numel, r.padded_numel)
        unsharded = _unsharded_bytes(u) / scale
        if row == previous and index != len(p.units) - 1:
            repeated.append(index)
            continue
        flush()
        repeated = [index]
        previous = row
        lines.append(f"  {index:>4}  {(u.name or '(root)')[:28]:<28} {row[0]:>14,} {row[1]:>15,} {unsharded:>14,.1f}")
    flush()
    return lines


def _peak_row(p: Prediction, peak: PhasePeak, label: str, scale: int) -> str:
    cells = " ".join(f"{peak.breakdown.get(c, 0) / scale:>9,.1f}" for c, _, _ in _COLUMNS)
    return f"  {label:<20} {peak.bytes / scale:>10,.1f}  {cells}  {_where(p, peak.at)}"


def _memory_table(p: Prediction, memory: ModelMemory) -> list[str]:
    name, scale = _unit_for(memory.peak.bytes)
    head1 = " ".join(f"{a:>9}" for _, a, _ in _COLUMNS)
    head2 = " ".join(f"{b:>9}" for _, _, b in _COLUMNS)
    lines = [f"  {'phase':<20} {'total ' + name:>10}  {head1}  reached at", f"  {'':<20} {'':>10}  {head2}"]
    accumulate = max(pk.micro for pk in memory.peaks) + 1
    for peak in memory.peaks:
        label = peak.phase.value
        if accumulate > 1 and peak.micro >= 0:
            label += " (sync)" if peak.micro == accumulate - 1 else f" (no_sync {peak.micro + 1})"
        lines.append(_peak_row(p, peak, label, scale))
    after = memory.after_step
    cells = " ".join(f"{after.get(c, 0) / scale:>9,.1f}" for c, _, _ in _COLUMNS)
    lines.append(f"  {'between steps':<20} {sum(after.values()) / scale:>10,.1f}  {cells}")
    return lines


def _strategy(p: Prediction) -> str:
    units = [u for u in p.units if u is not None]
    sharding = units[0].request.sharding
    strategy = sharding.strategy.name
    if sharding.strategy.is_hybrid:
        return f"{strategy}, {sharding.replicate_size} replicas of {sharding.shard_size} ranks"
    return strategy


def _api(p: Prediction) -> str:
    """The API and its options the prediction is for."""
    o = p.options
    if p.api == "fully_shard":
        sizes = {u.post_forward_ranks for u in p.units if u is not None} - {0}
        resharding = [f"groups of {n} ranks" for n in sorted(sizes)] or [
            "every block" if p.fully_shard is not None and any(p.fully_shard.forward_reshards[:-1]) else "no unit"
        ]
        lists = "; explicit prefetch" if p.fully_shard is not None and p.fully_shard.forward_prefetches else ""
        return f"fully_shard on each block, then the root; reshard after forward: {', '.join(resharding)}{lists}"
    prefetch = o.backward_prefetch.name if o.backward_prefetch else None
    return f"use_orig_params {o.use_orig_params}; backward_prefetch {prefetch}; forward_prefetch {o.forward_prefetch}"


def format_prediction(p: Prediction, *, model: str, inputs: str) -> str:
    """The units, then every phase's peak for the worst rank by category, where it is reached,
    and the spread over ranks."""
    units = [u for u in p.units if u is not None]
    o = p.options
    first = units[0].request
    mp = first.mixed_precision
    precision = (
        f"compute {first.compute_dtype}, reduce {first.reduce_dtype}".replace("torch.", "")
        if mp.param_dtype is not None or mp.reduce_dtype is not None
        else f"{first.layout.dtype}".replace("torch.", "")
    )
    runtime = (
        "the CPU runtime (gloo: exact bytes)"
        if p.backend == "gloo"
        else "an accelerator (nccl: device streams, the caching allocator's 512-byte blocks)"
    )
    total = sum(u.request.layout.numel_without_padding for u in units)
    worst = p.worst
    peaks = [m.peak.bytes for m in p.ranks]
    lines = [
        f"model: {model}, {total:,} parameters in {len(units)} units; each rank's batch: {inputs}",
        f"world {p.world_size}: {_strategy(p)}; {precision}; {p.optimizer.kind.value}; "
        f"offload {o.offload.offload_params}; {_api(p)}; {p.accumulate} backward(s) per step",
        f"predicted for {runtime}, steady state",
        "",
        "units (shard rank 0):",
        *_units_table(p),
        "",
        f"memory of the worst rank (shard rank {p.worst_rank}), by phase:",
        *_memory_table(p, worst),
        "",
        f"peak: {_amount(worst.peak.bytes)} ({worst.peak.bytes:,} B) in {worst.peak.phase.value}, at "
        f"{_where(p, worst.peak.at)}; the {len(p.ranks)} shard rank(s) peak at "
        f"{_amount(min(peaks))}-{_amount(max(peaks))}",
    ]
    return "\n".join(lines)


def _amount(nbytes: int) -> str:
    name, scale = _unit_for(nbytes)
    return f"{nbytes / scale:,.1f} {name}" if scale > 1 else f"{nbytes} B"


def _breakdown(parts: Mapping[Category, int]) -> dict[str, JsonValue]:
    return {c.value: v for c, v in parts.items()}


def _unit_json(u: UnitSpec | None, path: str) -> JsonValue:
    if u is None:
        return {"module": path, "parameters": 0}
    r = u.request
    return {
        "module": path,
        "parameters": r.layout.numel_without_padding,
        "flat_numel": r.layout.total_numel,
        "shard_numel": r.shard_numel,
        "padded_numel": r.padded_numel,
        "dtype": str(r.layout.dtype).removeprefix("torch."),
        "compute_dtype": str(r.compute_dtype).removeprefix("torch."),
    }


def _peak_json(p: Prediction, peak: PhasePeak) -> JsonValue:
    at = peak.at
    return {
        "phase": peak.phase.value,
        "micro": peak.micro,
        "bytes": peak.bytes,
        "at": None if at is None else (at.value if isinstance(at, Mark) else at.event.value),
        "unit": peak.unit,
        "where": _where(p, at),
        "breakdown": _breakdown(peak.breakdown),
    }


def prediction_to_json(p: Prediction, *, model: str, inputs: str) -> dict[str, JsonValue]:
    """Everything ``format_prediction`` shows, every rank's peaks included, in bytes."""
    ranks: list[JsonValue] = [
        {
            "shard_rank": rank,
            "peaks": [_peak_json(p, pk) for pk in m.peaks],
            "after_step": _breakdown(m.after_step),
            "peak": m.peak.bytes,
        }
        for rank, m in enumerate(p.ranks)
    ]
    units: Sequence[JsonValue] = [_unit_json(u, path) for u, path in zip(p.units, p.paths)]
    return {
        "model": model,
        "inputs": inputs,
        "world_size": p.world_size,
        "backend": p.backend,
        "units": list(units),
        "worst_rank": p.worst_rank,
        "ranks": ranks,
    }


def _exposed(p: Prediction, timeline: IterationTimeline) -> list[tuple[str, float]]:
    """Each unit's exposed communication in ``timeline``, most first."""
    out = [(p.paths[u] or "the root", timeline.exposed_ms(u)) for u in range(len(p.units))]
    return sorted((e for e in out if e[1] > 0), key=lambda e: -e[1])


def _compute_ms(timeline: IterationTimeline) -> float:
    return sum(i.duration_ms for i in timeline.intervals if i.stream.value == "compute")


def _window(t: StepTime) -> str:
    """The accumulation window's forward-backwards, or nothing without accumulation."""
    if t.no_sync is None:
        return ""
    again = "" if t.no_sync_again is None else f", then {t.accumulate - 2} x {t.no_sync_again.iteration_ms:,.1f} ms"
    return f" (inside no_sync: {t.no_sync.iteration_ms:,.1f} ms{again}; synchronising: {t.sync.iteration_ms:,.1f} ms)"


def format_step_time(p: Prediction, t: StepTime) -> str:
    """The modeled step time, its compute and exposed communication, the limiting link, the most
    exposed units and what was assumed."""
    sync = t.sync
    link = sync.limiting_link
    lines = [
        f"step time, modeled (fsdp_core.sim.simulate_iteration; not measured): {t.step_ms:,.1f} ms per optimizer step"
        + _window(t),
        f"  forward + backward compute {_compute_ms(sync):,.1f} ms at {t.flops_per_second / 1e12:g} TFLOP/s (traced "
        f"FLOPs); exposed communication {sync.iteration_ms - _compute_ms(sync):,.1f} ms; limited by "
        f"{'compute' if link is None else link.value}",
    ]
    exposed = _exposed(p, sync)
    if exposed:
        shown = ", ".join(f"{name} {ms:,.1f}" for name, ms in exposed[:4])
        lines.append(f"  most exposed (ms of their collectives beside no compute): {shown}")
    lines.append("  " + describe_cost(t.cost) + "; the optimizer step is not modeled")
    return "\n".join(lines)


def step_time_to_json(p: Prediction, t: StepTime) -> dict[str, JsonValue]:
    """``format_step_time``'s figures, in ms."""
    return {
        "step_ms": t.step_ms,
        "sync_ms": t.sync.iteration_ms,
        "no_sync_ms": None if t.no_sync is None else t.no_sync.iteration_ms,
        "no_sync_again_ms": None if t.no_sync_again is None else t.no_sync_again.iteration_ms,
        "compute_ms": _compute_ms(t.sync),
        "limiting_link": None if t.sync.limiting_link is None else t.sync.limiting_link.value,
        "exposed_ms": dict[str, JsonValue](_exposed(p, t.sync)),
        "flops_per_second": t.flops_per_second,
    }
