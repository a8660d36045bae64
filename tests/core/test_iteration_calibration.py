"""Calibrating the iteration simulator: the seed's table (all four numbers within ten percent, two
parameters fitted to two of them) and models fitted from measurements (latency and bandwidth
per collective and link, slowdowns under load, link sharing). Expected values are worked out
by hand.
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from fsdp_core import BackwardPrefetch, HybridAllReduce, Plan, ShardingStrategy
from fsdp_core.sim import (
    SEED_PARAMETERS,
    SEED_ROWS,
    Collective,
    ComputeSlowdown,
    IterationModel,
    Link,
    LinkModel,
    Load,
    MeasuredUnit,
    Measurements,
    SeedParameters,
    SharingSample,
    SlowdownSample,
    UnitCosts,
    compute_slowdown_of,
    fit_affine,
    fit_collectives,
    fit_seed,
    format_seed_table,
    links_from_measurements,
    model_from_measurements,
    seed_calibration,
    seed_model,
    simulate_iteration,
    slowdown,
    unit_plans,
)
from tests.core.iteration_cases import FSDP, HSDP_ASYNC, HSDP_SYNC, INTER, INTRA, emulated_cluster, sample

# -- the seed's table -------------------------------------------------------------------------


def test_all_four_seed_numbers_within_ten_percent_in_the_seed_order() -> None:
    results = seed_calibration().results
    assert [r.row.key for r in results] == ["fsdp", "hsdp_sync", "hsdp_async", "hsdp_async_cross_nic"]
    for r in results:
        assert abs(r.ratio - 1) <= 0.10, (r.row.key, r.simulated_ms, r.row.seed_ms)
    times = [r.simulated_ms for r in results]
    assert times[0] > times[1] > times[2] > times[3]


def test_two_parameters_are_fitted_to_two_numbers_and_reproduce_them() -> None:
    fitted = {r.row.key: r.row.fitted for r in seed_calibration().results}
    assert fitted == {
        "fsdp": None,
        "hsdp_sync": None,
        "hsdp_async": "encoder_forward_ms",
        "hsdp_async_cross_nic": "cross_nic_bandwidth_factor",
    }
    for r in seed_calibration().results:
        if r.row.fitted is not None:
            assert r.ratio == pytest.approx(1, abs=2e-4)


def test_the_fitted_parameters_are_what_the_code_says() -> None:
    fit = fit_seed()
    assert round(fit.encoder_forward_ms, 4) == SEED_PARAMETERS.encoder_forward_ms == 1.4563
    assert round(fit.cross_nic_bandwidth_factor, 4) == SEED_PARAMETERS.cross_nic_bandwidth_factor == 1.0874
    # The others are a priori, not fitted.
    a_priori = SeedParameters(encoder_forward_ms=0, cross_nic_bandwidth_factor=1)
    for name in ("backward_per_forward", "decoder_per_encoder_compute", "contention"):
        assert getattr(fit, name) == getattr(SEED_PARAMETERS, name) == getattr(a_priori, name)
    assert (SEED_PARAMETERS.backward_per_forward, SEED_PARAMETERS.contention) == (2.0, 1.0)
    assert SEED_PARAMETERS.decoder_per_encoder_compute == 40 / 23


def test_no_two_collectives_share_a_link_in_the_seed_rows_so_contention_has_no_effect() -> None:
    base = seed_calibration()
    for r in base.results:
        for link in Link:
            busy = sorted((i.start_ms, i.end_ms) for i in r.timeline.intervals if i.link is link and i.duration_ms > 0)
            assert all(a[1] <= b[0] for a, b in itertools.pairwise(busy))
    lossy = seed_calibration(dataclasses.replace(SEED_PARAMETERS, contention=3.0))
    assert [r.simulated_ms for r in lossy.results] == [r.simulated_ms for r in base.results]


def test_seed_model_shape() -> None:
    model = seed_model()
    assert [u.name for u in model.units] == ["root", *(f"enc{i}" for i in range(6)), *(f"dec{i}" for i in range(6))]
    enc, dec = model.units[1], model.units[7]
    assert enc.forward_ms == SEED_PARAMETERS.encoder_forward_ms and enc.backward_ms == 2 * enc.forward_ms
    assert dec.forward_ms == pytest.approx(enc.forward_ms * 40 / 23)
    assert enc.collectives is not None and dec.collectives is not None
    assert (enc.collectives.all_gather_inter_ms, dec.collectives.all_reduce_inter_ms) == (23, 55)
    assert model.backward_prefetch is BackwardPrefetch.BACKWARD_PRE and not model.forward_prefetch
    assert len(SEED_ROWS) == 4


def test_seed_table_text() -> None:
    text = format_seed_table(seed_calibration())
    assert "FSDP (FULL_SHARD, 32 GPUs)    1160" in text
    assert text.count("predicted") == 2 and "fitted: encoder_forward_ms" in text
    assert "no two collectives share a link" in text and "refitted" not in text
    other = format_seed_table(seed_calibration(one_collective_per_group=False))
    assert "one_collective_per_group=False" in other and "nothing refitted" in other


# -- calibration from measurements --------------------------------------------------------------


def test_fit_affine_recovers_latency_and_bandwidth() -> None:
    # 0.5 ms + 1 ms per 50 kB (400 Mbit/s).
    points = [sample(Collective.ALL_GATHER, INTER, n, 0.5 + n / 50_000) for n in (100_000, 1_000_000, 4_000_000)]
    fit = fit_affine(points)
    assert fit.latency_ms == pytest.approx(0.5) and fit.ms_per_byte == pytest.approx(1 / 50_000)
    assert fit.ms(0) == 0 and fit.ms(2_000_000) == pytest.approx(40.5)
    assert fit_affine(list(reversed(points))) == fit


def test_fit_affine_one_size_and_negative_latency_go_through_the_origin() -> None:
    one = fit_affine([sample(Collective.ALL_REDUCE, INTER, 1000, 2.0), sample(Collective.ALL_REDUCE, INTER, 1000, 4.0)])
    assert (one.latency_ms, one.ms_per_byte) == (0.0, 3.0 / 1000)
    negative = fit_affine(
        [sample(Collective.ALL_REDUCE, INTER, 1000, 1.0), sample(Collective.ALL_REDUCE, INTER, 2000, 3.0)]
    )
    assert negative.latency_ms == 0.0 and negative.ms_per_byte == pytest.approx(7.0 / 5000)
    flat = fit_affine(
        [sample(Collective.ALL_REDUCE, INTER, 1000, 3.0), sample(Collective.ALL_REDUCE, INTER, 2000, 1.0)]
    )
    assert (flat.latency_ms, flat.ms_per_byte) == (2.0, 0.0)
    with pytest.raises(ValueError, match="at least one"):
        fit_affine([])


def test_fit_collectives_names_what_is_missing() -> None:
    with pytest.raises(
        ValueError, match="reduce_scatter on intra_node, reduce_scatter on inter_node, all_reduce on inter_node"
    ):
        fit_collectives([sample(Collective.ALL_GATHER, INTRA, 10, 1.0), sample(Collective.ALL_GATHER, INTER, 10, 1.0)])


def cluster_plans(kind: str) -> tuple[Plan, ...]:
    """The three units' plans on 2 nodes of 2 ranks."""
    if kind == FSDP:
        return unit_plans(3, ShardingStrategy.FULL_SHARD, 4)
    placement = HybridAllReduce.SYNC if kind == HSDP_SYNC else HybridAllReduce.ASYNC
    return unit_plans(3, ShardingStrategy.HYBRID_SHARD, 4, 2, hybrid_all_reduce=placement)


def test_model_from_measurements_prices_each_unit_at_its_size() -> None:
    model = model_from_measurements(emulated_cluster(), cluster_plans(HSDP_ASYNC))
    root, layer = model.units[0], model.units[1]
    assert (layer.forward_ms, layer.backward_ms) == (5.0, 10.0)
    c = layer.collectives
    assert c is not None and root.collectives is not None
    assert c.all_gather_intra_ms == pytest.approx(0.1 + 2.0)
    assert c.reduce_scatter_intra_ms == pytest.approx(0.2 + 2.0)
    assert c.all_gather_inter_ms == pytest.approx(1.0 + 80.0)
    assert c.reduce_scatter_inter_ms == pytest.approx(1.5 + 80.0)
    # The all-reduce reduces one shard: 4e6 / 2 ranks per node = 2e6 bytes, at 1 ms per 25 kB.
    assert c.all_reduce_inter_ms == pytest.approx(2.0 + 80.0)
    # ceil(2_000_001 / 2) = 1_000_001 bytes.
    assert root.collectives.all_reduce_inter_ms == pytest.approx(2.0 + 1_000_001 / 2.5e4)
    hand = IterationModel(
        units=tuple(
            UnitCosts(name=u.name, forward_ms=u.forward_ms, backward_ms=u.backward_ms, collectives=u.collectives)
            for u in model.units
        ),
        plans=model.plans,
        ranks_per_node=2,
    )
    assert simulate_iteration(model) == simulate_iteration(hand)
    # On a 400 Mbit/s link the replicate all-reduces dominate: async overlaps them with backward.
    times = {
        kind: simulate_iteration(model_from_measurements(emulated_cluster(), cluster_plans(kind))).iteration_ms
        for kind in (FSDP, HSDP_SYNC, HSDP_ASYNC)
    }
    assert times[HSDP_SYNC] > times[HSDP_ASYNC]


def test_measurements_validate() -> None:
    with pytest.raises(ValueError, match="ranks_per_node"):
        Measurements(units=emulated_cluster().units, samples=(), ranks_per_node=0)
    with pytest.raises(ValueError, match="nbytes"):
        sample(Collective.ALL_GATHER, INTER, 0, 1.0)
    with pytest.raises(ValueError, match="param_bytes"):
        MeasuredUnit(name="u", param_bytes=-1, forward_ms=0, backward_ms=0)


def slowed(load: Load, collective: Collective, link: Link, alone: float, loaded: float) -> SlowdownSample:
    return SlowdownSample(load=load, collective=collective, link=link, alone_ms=alone, loaded_ms=loaded)


def test_links_from_measurements_by_hand() -> None:
    base = emulated_cluster()
    # Nothing timed under load: the default link model.
    assert links_from_measurements(base) == LinkModel()
    slowdowns = (
        # Across links, intra-node: (3 + 5) / (2 + 4) = 4/3.
        slowed(Load.OTHER_LINK, Collective.ALL_GATHER, INTRA, 2.0, 3.0),
        slowed(Load.OTHER_LINK, Collective.REDUCE_SCATTER, INTRA, 4.0, 5.0),
        # The all-reduce beside intra-node traffic: recorded, not used (the model is one-sided).
        slowed(Load.OTHER_LINK, Collective.ALL_REDUCE, INTER, 20.0, 40.0),
        # Beside compute, per collective: 8 / 2 = 4; (10 + 14) / (4 + 4) = 3 (two samples);
        # 30 / 20 = 1.5; 5 / 10 is faster: 1. The inter-node reduce-scatter, not timed: 1.
        slowed(Load.COMPUTE, Collective.ALL_GATHER, INTRA, 2.0, 8.0),
        slowed(Load.COMPUTE, Collective.REDUCE_SCATTER, INTRA, 4.0, 10.0),
        slowed(Load.COMPUTE, Collective.REDUCE_SCATTER, INTRA, 4.0, 14.0),
        slowed(Load.COMPUTE, Collective.ALL_REDUCE, INTER, 20.0, 30.0),
        slowed(Load.COMPUTE, Collective.ALL_GATHER, INTER, 10.0, 5.0),
    )
    # Sharing: 10 and 14 ms alone, 30 together: 2 * 10 * c + 4 = 30, c = 1.3. With a second pair
    # (2 and 2 alone, 3 together: faster than in turn) from the sums: (26 + 3) / (20 + 4).
    one = SharingSample(link=INTER, first_ms=10.0, second_ms=14.0, together_ms=30.0)
    two = SharingSample(link=INTRA, first_ms=2.0, second_ms=2.0, together_ms=3.0)
    links = links_from_measurements(dataclasses.replace(base, slowdowns=slowdowns, sharing=(one,)))
    assert links.cross_link_slowdown == pytest.approx(4 / 3)
    assert links.compute_slowdown == ComputeSlowdown(
        all_gather_intra=4.0, reduce_scatter_intra=3.0, all_reduce_inter=1.5
    )
    assert links.contention == pytest.approx(1.3) and links.one_collective_per_group
    assert (links.inter_node_bandwidth, links.intra_node_bandwidth) == (1.0, 1.0)
    both = links_from_measurements(dataclasses.replace(base, sharing=(one, two)), one_collective_per_group=False)
    assert both.contention == pytest.approx(29 / 24) and not both.one_collective_per_group
    # A load that speeds a collective up, or sharing faster than taking turns, gives 1, not less.
    faster = (slowed(Load.COMPUTE, Collective.ALL_REDUCE, INTER, 20.0, 18.0),)
    assert links_from_measurements(dataclasses.replace(base, slowdowns=faster, sharing=(two,))) == LinkModel()


def test_compute_slowdown_of_one_node_by_hand() -> None:
    samples = (
        # All-gathers on both links: (8 + 6) / (2 + 5) = 2 for both links when they are one node.
        slowed(Load.COMPUTE, Collective.ALL_GATHER, INTRA, 2.0, 8.0),
        slowed(Load.COMPUTE, Collective.ALL_GATHER, INTER, 5.0, 6.0),
        # An all-reduce timed inside a node counts for the all-reduce (inter-node only otherwise).
        slowed(Load.COMPUTE, Collective.ALL_REDUCE, INTRA, 4.0, 10.0),
        # Another load is ignored.
        slowed(Load.OTHER_LINK, Collective.REDUCE_SCATTER, INTRA, 1.0, 9.0),
    )
    assert compute_slowdown_of(samples, one_node=True) == ComputeSlowdown(
        all_gather_intra=2.0, all_gather_inter=2.0, all_reduce_inter=2.5
    )
    # Per link: 8 / 2 and 6 / 5; the all-reduce's only sample is on the other link: 1.
    assert compute_slowdown_of(samples) == ComputeSlowdown(all_gather_intra=4.0, all_gather_inter=1.2)
    assert compute_slowdown_of(()) == ComputeSlowdown()


def test_slowdown_is_the_ratio_of_sums_at_least_one() -> None:
    assert slowdown([1.0, 3.0], [2.0, 4.0]) == 1.5
    assert slowdown([2.0], [1.0]) == 1.0
    assert slowdown([], []) == 1.0
    assert slowdown([0.0], [5.0]) == 1.0


def test_slowdown_and_sharing_samples_validate() -> None:
    with pytest.raises(ValueError, match="loaded_ms"):
        slowed(Load.COMPUTE, Collective.ALL_GATHER, INTRA, 1.0, -1.0)
    with pytest.raises(TypeError, match="load"):
        SlowdownSample(
            load="compute",  # type: ignore[arg-type]
            collective=Collective.ALL_GATHER,
            link=INTRA,
            alone_ms=1.0,
            loaded_ms=1.0,
        )
    with pytest.raises(ValueError, match="together_ms"):
        SharingSample(link=INTER, first_ms=1.0, second_ms=1.0, together_ms=float("inf"))
    with pytest.raises(TypeError, match="slowdowns"):
        dataclasses.replace(emulated_cluster(), slowdowns=[])  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="sharing"):
        dataclasses.replace(emulated_cluster(), sharing=(1.0,))  # type: ignore[arg-type]
