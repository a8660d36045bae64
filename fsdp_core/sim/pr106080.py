"""The seed's table, reproduced by ``simulate_iteration``: PyTorch PR 106080 ("Enable async
all-reduce for HSDP"), 4 nodes x 8 A100, a 6-encoder + 6-decoder-layer transformer (d_model 8192,
nhead 64), ms per iteration:

======================================================  =====
FSDP, ``FULL_SHARD`` over all 32 GPUs                   1160
HSDP, all-reduce after the reduce-scatter (before PR)    665
HSDP, all-reduce on its own stream (async)               597
async HSDP with ``NCCL_CROSS_NIC=1``                     556
======================================================  =====

The seed also gives each layer's collectives alone: all-gather or reduce-scatter about 23 / 40 ms
(encoder / decoder) across nodes, 3 / 5 ms inside a node, replicate all-reduce 30 / 55 ms. It
does not give compute times, how sharing a link slows a collective, or what ``NCCL_CROSS_NIC=1``
changes: those are the named free parameters of ``SeedParameters``. Two of them are fitted, each
to one seed number, by bisection (``fit_seed``); the other two seed numbers are predictions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from fsdp_core.plan.request import Plan
from fsdp_core.sim.iteration import simulate_iteration
from fsdp_core.sim.iteration_model import CollectiveCosts, IterationModel, LinkModel, UnitCosts, unit_plans
from fsdp_core.sim.iteration_timeline import IterationTimeline
from fsdp_core.sim.render import format_iteration
from fsdp_core.spec.config import HybridAllReduce, ShardingStrategy

__all__ = [
    "SEED_DECODER",
    "SEED_ENCODER",
    "SEED_PARAMETERS",
    "SEED_ROWS",
    "SeedCalibration",
    "SeedParameters",
    "SeedResult",
    "SeedRow",
    "fit_seed",
    "format_seed_table",
    "format_seed_timeline",
    "seed_calibration",
    "seed_links",
    "seed_model",
    "seed_plans",
]

SEED_ENCODER = CollectiveCosts(
    all_gather_intra_ms=3.0,
    all_gather_inter_ms=23.0,
    reduce_scatter_intra_ms=3.0,
    reduce_scatter_inter_ms=23.0,
    all_reduce_inter_ms=30.0,
)
"""An encoder layer's collectives alone, as the seed gives them."""
SEED_DECODER = CollectiveCosts(
    all_gather_intra_ms=5.0,
    all_gather_inter_ms=40.0,
    reduce_scatter_intra_ms=5.0,
    reduce_scatter_inter_ms=40.0,
    all_reduce_inter_ms=55.0,
)
"""A decoder layer's collectives alone, as the seed gives them."""
_NOTHING = CollectiveCosts(
    all_gather_intra_ms=0.0,
    all_gather_inter_ms=0.0,
    reduce_scatter_intra_ms=0.0,
    reduce_scatter_inter_ms=0.0,
    all_reduce_inter_ms=0.0,
)


@dataclass(frozen=True, slots=True, kw_only=True)
class SeedParameters:
    """What the seed does not give. Two are fitted (``fit_seed``), the others fixed a priori."""

    encoder_forward_ms: float
    """FITTED to async HSDP's 597 ms: one encoder layer's forward compute."""
    cross_nic_bandwidth_factor: float
    """FITTED to the ``NCCL_CROSS_NIC=1`` row's 556 ms: how much faster the inter-node link is
    with it (``LinkModel.inter_node_bandwidth``)."""
    backward_per_forward: float = 2.0
    """A priori: a layer's backward takes twice its forward (twice the matmul FLOPs)."""
    decoder_per_encoder_compute: float = 40.0 / 23.0
    """A priori: a decoder layer computes as much more than an encoder layer as its collectives
    move (40 / 23 ms), i.e. compute and bytes both scale with the parameter count."""
    contention: float = 1.0
    """A priori: ideal sharing (``LinkModel.contention``). It has no effect on the four rows:
    with one collective per process group at a time (FSDP1 on NCCL), no two collectives ever share
    a link here."""

    def __post_init__(self) -> None:
        for name in (
            "encoder_forward_ms",
            "cross_nic_bandwidth_factor",
            "backward_per_forward",
            "decoder_per_encoder_compute",
            "contention",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
                raise ValueError(f"SeedParameters.{name}: expected a finite number >= 0, got {value!r}")


SEED_PARAMETERS = SeedParameters(
    # fit_seed(): bisection of encoder_forward_ms over [0, 20] ms, 60 halvings, until async
    # HSDP's simulated iteration is 597 ms: 1.4563318777292604, rounded to 4 decimals.
    encoder_forward_ms=1.4563,
    # fit_seed(): then bisection of the factor over [1, 4], 60 halvings, until the
    # NCCL_CROSS_NIC=1 row is 556 ms: 1.0874200426439233, rounded to 4 decimals.
    cross_nic_bandwidth_factor=1.0874,
)
"""The fitted values ``fit_seed()`` gives, rounded to 4 decimals (a test re-runs the fit)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SeedRow:
    """One row of the seed's table."""

    key: str
    """A short name: ``fsdp``, ``hsdp_sync``, ``hsdp_async``, ``hsdp_async_cross_nic``."""
    label: str
    strategy: ShardingStrategy
    """``FULL_SHARD`` over all 32 GPUs, or ``HYBRID_SHARD`` with a shard group per node."""
    hybrid_all_reduce: HybridAllReduce
    """Where the plans put the replicate all-reduce (``ASYNC`` for ``FULL_SHARD``, which has none)."""
    cross_nic: bool
    """Whether ``NCCL_CROSS_NIC=1`` was set."""
    seed_ms: float
    """The seed's iteration time."""
    fitted: str | None
    """The ``SeedParameters`` field fitted to this row, or None for a prediction."""


SEED_ROWS: tuple[SeedRow, ...] = (
    SeedRow(
        key="fsdp",
        label="FSDP (FULL_SHARD, 32 GPUs)",
        strategy=ShardingStrategy.FULL_SHARD,
        hybrid_all_reduce=HybridAllReduce.ASYNC,
        cross_nic=False,
        seed_ms=1160.0,
        fitted=None,
    ),
    SeedRow(
        key="hsdp_sync",
        label="HSDP, sync all-reduce",
        strategy=ShardingStrategy.HYBRID_SHARD,
        hybrid_all_reduce=HybridAllReduce.SYNC,
        cross_nic=False,
        seed_ms=665.0,
        fitted=None,
    ),
    SeedRow(
        key="hsdp_async",
        label="HSDP, async all-reduce",
        strategy=ShardingStrategy.HYBRID_SHARD,
        hybrid_all_reduce=HybridAllReduce.ASYNC,
        cross_nic=False,
        seed_ms=597.0,
        fitted="encoder_forward_ms",
    ),
    SeedRow(
        key="hsdp_async_cross_nic",
        label="HSDP async, CROSS_NIC=1",
        strategy=ShardingStrategy.HYBRID_SHARD,
        hybrid_all_reduce=HybridAllReduce.ASYNC,
        cross_nic=True,
        seed_ms=556.0,
        fitted="cross_nic_bandwidth_factor",
    ),
)
"""The seed's four numbers, in its order."""


SEED_NODES = 4
SEED_RANKS_PER_NODE = 8


def seed_plans(row: SeedRow) -> tuple[Plan, ...]:
    """The 13 units' post-backward plans of ``row``: ``FULL_SHARD`` over the 32 GPUs, or
    ``HYBRID_SHARD`` with a shard group per node and the row's all-reduce placement."""
    world = SEED_NODES * SEED_RANKS_PER_NODE
    hybrid = row.strategy.is_hybrid
    return unit_plans(
        13,
        row.strategy,
        world,
        SEED_RANKS_PER_NODE if hybrid else None,
        hybrid_all_reduce=row.hybrid_all_reduce if hybrid else HybridAllReduce.ASYNC,
    )


def seed_model(params: SeedParameters = SEED_PARAMETERS, row: SeedRow | None = None) -> IterationModel:
    """The seed's model: a root (the embeddings and output layer, which the seed does not time:
    zero cost), 6 encoder layers, then 6 decoder layers, each an FSDP unit, with FSDP1's
    defaults (``BACKWARD_PRE``, no forward prefetch), 8 GPUs a node, and the plans of ``row``
    (default: async HSDP)."""
    encoder_ms = params.encoder_forward_ms
    decoder_ms = encoder_ms * params.decoder_per_encoder_compute
    root = UnitCosts(name="root", forward_ms=0.0, backward_ms=0.0, collectives=_NOTHING)
    encoders = tuple(
        UnitCosts(
            name=f"enc{i}",
            forward_ms=encoder_ms,
            backward_ms=encoder_ms * params.backward_per_forward,
            collectives=SEED_ENCODER,
        )
        for i in range(6)
    )
    decoders = tuple(
        UnitCosts(
            name=f"dec{i}",
            forward_ms=decoder_ms,
            backward_ms=decoder_ms * params.backward_per_forward,
            collectives=SEED_DECODER,
        )
        for i in range(6)
    )
    plans = seed_plans(SEED_ROWS[2] if row is None else row)
    return IterationModel(units=(root, *encoders, *decoders), plans=plans, ranks_per_node=SEED_RANKS_PER_NODE)


def seed_links(
    params: SeedParameters = SEED_PARAMETERS, *, cross_nic: bool = False, one_collective_per_group: bool = True
) -> LinkModel:
    """The link model of a seed row: ``contention``, and the cross-NIC factor when ``cross_nic``."""
    return LinkModel(
        contention=params.contention,
        inter_node_bandwidth=params.cross_nic_bandwidth_factor if cross_nic else 1.0,
        one_collective_per_group=one_collective_per_group,
    )


def _simulate(row: SeedRow, params: SeedParameters, one_collective_per_group: bool = True) -> IterationTimeline:
    links = seed_links(params, cross_nic=row.cross_nic, one_collective_per_group=one_collective_per_group)
    return simulate_iteration(seed_model(params, row), links)


def _bisect(f: Callable[[float], float], low: float, high: float, halvings: int) -> float:
    """The root of the monotone ``f`` between ``low`` and ``high`` (signs must differ), as the
    midpoint after ``halvings`` halvings."""
    f_low = f(low)
    if (f_low > 0) == (f(high) > 0):
        raise ValueError(f"bisection: no sign change over [{low}, {high}]")
    for _ in range(halvings):
        mid = (low + high) / 2
        if (f(mid) > 0) == (f_low > 0):
            low = mid
        else:
            high = mid
    return (low + high) / 2


def fit_seed(halvings: int = 60) -> SeedParameters:
    """Fit the two free parameters, deterministically, with the others at their a priori values:

    1. ``encoder_forward_ms``: bisection over [0, 20] ms until the simulated async HSDP
       iteration (no cross-NIC) equals the seed's 597 ms. It is the only free parameter that row
       depends on.
    2. ``cross_nic_bandwidth_factor``: then bisection over [1, 4] until the ``NCCL_CROSS_NIC=1``
       row equals 556 ms.

    Unrounded; ``SEED_PARAMETERS`` holds the result rounded to 4 decimals."""
    by_key = {row.key: row for row in SEED_ROWS}
    start = SeedParameters(encoder_forward_ms=0.0, cross_nic_bandwidth_factor=1.0)
    async_row, cross_row = by_key["hsdp_async"], by_key["hsdp_async_cross_nic"]

    def async_gap(ms: float) -> float:
        return _simulate(async_row, replace(start, encoder_forward_ms=ms)).iteration_ms - async_row.seed_ms

    compute = replace(start, encoder_forward_ms=_bisect(async_gap, 0.0, 20.0, halvings))

    def cross_gap(factor: float) -> float:
        return (
            _simulate(cross_row, replace(compute, cross_nic_bandwidth_factor=factor)).iteration_ms - cross_row.seed_ms
        )

    return replace(compute, cross_nic_bandwidth_factor=_bisect(cross_gap, 1.0, 4.0, halvings))


@dataclass(frozen=True, slots=True, kw_only=True)
class SeedResult:
    """One seed row, simulated."""

    row: SeedRow
    timeline: IterationTimeline

    @property
    def simulated_ms(self) -> float:
        """The simulated iteration time."""
        return self.timeline.iteration_ms

    @property
    def ratio(self) -> float:
        """Simulated over seed."""
        return self.timeline.iteration_ms / self.row.seed_ms


@dataclass(frozen=True, slots=True, kw_only=True)
class SeedCalibration:
    """The seed's table simulated with one set of parameters."""

    params: SeedParameters
    one_collective_per_group: bool
    """``LinkModel.one_collective_per_group`` of every row."""
    results: tuple[SeedResult, ...]


def seed_calibration(
    params: SeedParameters = SEED_PARAMETERS, *, one_collective_per_group: bool = True
) -> SeedCalibration:
    """Simulate every row of ``SEED_ROWS`` with ``params`` (the fitted ones by default).

    Other ``params`` (a ``contention`` above 1, say) or ``one_collective_per_group=False`` show
    how sensitive the rows are to those choices; nothing is refitted."""
    results = tuple(SeedResult(row=row, timeline=_simulate(row, params, one_collective_per_group)) for row in SEED_ROWS)
    return SeedCalibration(params=params, one_collective_per_group=one_collective_per_group, results=results)


def format_seed_table(calibration: SeedCalibration) -> str:
    """The seed's table beside the simulated one, which numbers are fitted and which predicted,
    and the free parameters."""
    p = calibration.params
    lines = [
        "PyTorch PR 106080, 4 nodes x 8 A100, 6 encoder + 6 decoder layers: ms per iteration",
        f"  {'schedule':<27} {'seed':>6} {'simulated':>10} {'sim/seed':>9}  role",
    ]
    for r in calibration.results:
        role = "predicted" if r.row.fitted is None else f"fitted: {r.row.fitted}"
        lines.append(f"  {r.row.label:<27} {r.row.seed_ms:>6.0f} {r.simulated_ms:>10.1f} {r.ratio:>9.3f}  {role}")
    lines += [
        "free parameters:",
        f"  encoder_forward_ms          {p.encoder_forward_ms:<8.4f} fitted to async HSDP 597 ms (bisection)",
        f"  cross_nic_bandwidth_factor  {p.cross_nic_bandwidth_factor:<8.4f} fitted to CROSS_NIC=1 556 ms (bisection)",
        f"  backward_per_forward        {p.backward_per_forward:<8.4g} a priori: backward = 2 x forward FLOPs",
        f"  decoder_per_encoder_compute {p.decoder_per_encoder_compute:<8.4f} a priori: 40/23, as their collectives",
        f"  contention                  {p.contention:<8.4g} a priori (1: ideal sharing)",
    ]
    if calibration.one_collective_per_group:
        lines.append("one collective per process group at a time: no two collectives share a link in these rows")
    else:
        lines.append(
            "collectives of one process group run concurrently and share links (one_collective_per_group=False)"
        )
    if p != SEED_PARAMETERS or not calibration.one_collective_per_group:
        lines.append("(not the fitted configuration; nothing refitted)")
    return "\n".join(lines)


def format_seed_timeline(result: SeedResult, width: int = 100) -> str:
    """The row's label, then ``format_iteration`` of its timeline headed by the row's key,
    ``width`` columns wide."""
    return f"{result.row.label}:\n{format_iteration(result.timeline, width, name=result.row.key)}"
