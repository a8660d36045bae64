"""The whole-iteration simulator's link model (``run_tasks``): transfers sharing a link,
contention, slowdowns across links, beside compute and of compute, dependencies, and bad input
refused. Expected times are worked out by hand, as exact fractions.
"""

from __future__ import annotations

from fractions import Fraction

import pytest

from fsdp_core.sim import Link, SimTask, run_tasks
from tests.core.iteration_cases import INTER, INTRA

F = Fraction
ONE = {INTER: F(1), INTRA: F(1)}


# -- the link model ---------------------------------------------------------------------------


def spans(*pairs: tuple[int, int]) -> tuple[tuple[Fraction, Fraction], ...]:
    """Exact (start, end) pairs, as ``run_tasks`` returns them."""
    return tuple((F(a), F(b)) for a, b in pairs)


def transfer(work: int, link: Link = INTER, after: tuple[int, ...] = (), beside_compute: int = 1) -> SimTask:
    return SimTask(after=after, work=F(work), link=link, compute_slowdown=F(beside_compute))


def test_a_lone_transfer_takes_its_cost() -> None:
    assert run_tasks([transfer(7)], capacity=ONE) == spans((0, 7))


def test_two_equal_transfers_sharing_a_link_take_twice_as_long() -> None:
    assert run_tasks([transfer(10), transfer(10)], capacity=ONE) == spans((0, 20), (0, 20))


def test_contention_slows_shared_transfers_beyond_the_split() -> None:
    # Each at 1 / (2 * 1.5) of the link: 10 ms of work take 30 ms.
    assert run_tasks([transfer(10), transfer(10)], capacity=ONE, contention=F(3, 2)) == spans((0, 30), (0, 30))
    # Contention costs nothing to a transfer alone.
    assert run_tasks([transfer(10)], capacity=ONE, contention=F(3)) == spans((0, 10))


def test_unequal_transfers_share_until_the_shorter_ends() -> None:
    # Both at half speed until 4 ms of work are done at t=8; the rest (6 ms) alone: 14.
    assert run_tasks([transfer(10), transfer(4)], capacity=ONE) == spans((0, 14), (0, 8))


def test_a_transfer_joining_later_shares_only_from_then_on() -> None:
    # A alone for 4 ms (6 left); then A and B at half speed: B's 4 ms end at 12, A has 2 left: 14.
    tasks = [transfer(10), SimTask(after=(), work=F(4)), transfer(4, after=(1,))]
    assert run_tasks(tasks, capacity=ONE) == spans((0, 14), (0, 4), (4, 12))


def test_different_links_and_compute_do_not_share() -> None:
    tasks = [transfer(10, INTER), transfer(10, INTRA), SimTask(after=(), work=F(10)), SimTask(after=(), work=F(10))]
    assert run_tasks(tasks, capacity=ONE) == spans((0, 10)) * 4


def test_capacity_scales_a_link() -> None:
    assert run_tasks([transfer(10)], capacity={INTER: F(2)}) == spans((0, 5))


def test_dependencies_and_zero_work() -> None:
    tasks = [SimTask(after=(), work=F(3)), SimTask(after=(0,), work=F(0)), transfer(2, after=(1,))]
    assert run_tasks(tasks, capacity=ONE) == spans((0, 3), (3, 3), (3, 5))


def test_an_inter_node_transfer_slows_intra_node_ones_and_not_the_reverse() -> None:
    # The intra-node transfer at half speed while the inter-node one runs (0-10: 5 ms of its
    # work), then alone (5 more): 15. The inter-node one is not slowed: 10.
    tasks = [transfer(10, INTRA), transfer(10, INTER)]
    assert run_tasks(tasks, capacity=ONE, cross_link_slowdown=F(2)) == spans((0, 15), (0, 10))
    # Transfers on one link only: no slowdown across links, only sharing.
    assert run_tasks([transfer(10, INTRA), transfer(10, INTRA)], capacity=ONE, cross_link_slowdown=F(3)) == spans(
        (0, 20), (0, 20)
    )
    # Compute on its own is no other link.
    tasks = [transfer(10, INTRA), SimTask(after=(), work=F(10))]
    assert run_tasks(tasks, capacity=ONE, cross_link_slowdown=F(2)) == spans((0, 10), (0, 10))


def test_compute_slows_each_transfer_by_its_own_factor() -> None:
    # 0-4 beside compute at half speed (2 ms of work), the other 8 alone: 12. A transfer with
    # factor 1 is not slowed; compute never is.
    tasks = [SimTask(after=(), work=F(4)), transfer(10, INTRA, beside_compute=2), transfer(10, INTER)]
    assert run_tasks(tasks, capacity=ONE) == spans((0, 4), (0, 12), (0, 10))
    # Two transfers on one link, different factors: each slowed by its own.
    tasks = [SimTask(after=(), work=F(4)), transfer(4, beside_compute=2), transfer(4, beside_compute=4)]
    # 0-4: at 1/(2*2) and 1/(2*4): 1 and 1/2 ms of work; then both at 1/2: the first's 3 ms at
    # 10, the second has 1/2 left, alone: 10.5.
    assert run_tasks(tasks, capacity=ONE) == ((F(0), F(4)), (F(0), F(10)), (F(0), F(21, 2)))


def test_transfers_slow_compute_while_any_is_active() -> None:
    # 0-4 beside the transfer at half speed (2 ms of its work), its other 4 alone: 8. The
    # transfer is not slowed (its own factor is 1).
    tasks = [SimTask(after=(), work=F(6)), transfer(4, INTRA)]
    assert run_tasks(tasks, capacity=ONE, transfers_slow_compute=F(2)) == spans((0, 8), (0, 4))
    # Both ways at half speed (one processor shared): the transfer's 4 ms take 8, in which the
    # compute does 4 of its 6; its last 2 alone: 10, the sum of the two.
    tasks = [SimTask(after=(), work=F(6)), transfer(4, INTRA, beside_compute=2)]
    assert run_tasks(tasks, capacity=ONE, transfers_slow_compute=F(2)) == spans((0, 10), (0, 8))
    # Nothing slows compute that runs alone.
    assert run_tasks([SimTask(after=(), work=F(6))], capacity=ONE, transfers_slow_compute=F(5)) == spans((0, 6))
    with pytest.raises(ValueError, match="transfers_slow_compute"):
        run_tasks(tasks, capacity=ONE, transfers_slow_compute=F(1, 2))


def test_slowdowns_multiply() -> None:
    # Intra-node: 0-6 beside compute and the inter-node transfer at 1/(3*2) (1 ms of work); 6-20
    # beside the inter-node one at 1/2 (7 ms); its last 4 ms alone: 24.
    tasks = [SimTask(after=(), work=F(6)), transfer(12, INTRA, beside_compute=3), transfer(20, INTER)]
    times = run_tasks(tasks, capacity=ONE, cross_link_slowdown=F(2))
    assert times == spans((0, 6), (0, 24), (0, 20))
    # Sharing too: two intra-node transfers beside the inter-node one, each at 1/(2*2*2) with
    # contention 2 until it ends at 8 (1 ms of work each), then at 1/(2*2): 3 ms more take 12.
    tasks = [transfer(4, INTRA), transfer(4, INTRA), transfer(8, INTER)]
    times = run_tasks(tasks, capacity=ONE, contention=F(2), cross_link_slowdown=F(2))
    assert times == spans((0, 20), (0, 20), (0, 8))


def test_speedups_are_rejected() -> None:
    with pytest.raises(ValueError, match="cross_link_slowdown"):
        run_tasks([transfer(1)], capacity=ONE, cross_link_slowdown=F(1, 2))
    with pytest.raises(ValueError, match="compute_slowdown"):
        SimTask(after=(), work=F(1), link=INTRA, compute_slowdown=F(9, 10))
    with pytest.raises(ValueError, match="compute_slowdown"):
        SimTask(after=(), work=F(1), compute_slowdown=F(2))  # compute is never slowed


@pytest.mark.parametrize(
    ("tasks", "capacity", "contention", "fragment"),
    [
        ([SimTask(after=(0,), work=F(1))], ONE, F(1), r"tasks\[0\]\.after"),
        ([transfer(1)], {INTRA: F(1)}, F(1), "capacity"),
        ([transfer(1)], ONE, F(1, 2), "contention"),
    ],
)
def test_run_tasks_rejects_bad_input(
    tasks: list[SimTask], capacity: dict[Link, Fraction], contention: Fraction, fragment: str
) -> None:
    with pytest.raises(ValueError, match=fragment):
        run_tasks(tasks, capacity=capacity, contention=contention)
