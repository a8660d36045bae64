"""FSDP's all-gather side as data: what to gather, await and reshard at each hook of one iteration.

The shell records, on the first iteration, the order in which units run forward and the order in
which their pre-backward hooks fire. ``plan_unshard`` turns that record into an
``UnshardSchedule``: for every (hook event, unit) the actions to run there, with FSDP1's
``backward_prefetch`` and ``forward_prefetch`` semantics. ``check_unshard``
(``fsdp_core.unshard.verifier``) proves a schedule sound by simulating one iteration. Units the
record does not cover get the on-demand actions (gather and wait right before use), which are
always safe.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Union, assert_never

from fsdp_core.spec.config import BackwardPrefetch, ShardingStrategy
from fsdp_core.spec.events import Event, HookEvent

__all__ = [
    "AwaitGather",
    "Gather",
    "PerUnitGathers",
    "Reshard",
    "UnshardAction",
    "UnshardRequest",
    "UnshardSchedule",
    "UnshardStep",
    "action_name",
    "per_param_unshard_request",
    "plan_unshard",
    "unshard_request",
]


def _check_unit(what: str, unit: object) -> None:
    if not isinstance(unit, int) or isinstance(unit, bool):
        raise TypeError(f"{what}: expected an int, got {unit!r}")
    if unit < 0:
        raise ValueError(f"{what}: expected a unit index >= 0, got {unit}")


@dataclass(frozen=True, slots=True, kw_only=True)
class Gather:
    """Issue the asynchronous all-gather of ``unit``'s flat parameter, unless it is already
    gathered or in flight (then nothing happens)."""

    unit: int

    def __post_init__(self) -> None:
        _check_unit("Gather.unit", self.unit)


@dataclass(frozen=True, slots=True, kw_only=True)
class AwaitGather:
    """Block until ``unit``'s all-gather has landed; then its parameters may be used. The shell
    issues the all-gather first if it never was."""

    unit: int

    def __post_init__(self) -> None:
        _check_unit("AwaitGather.unit", self.unit)


@dataclass(frozen=True, slots=True, kw_only=True)
class Reshard:
    """Free ``unit``'s unsharded flat parameter."""

    unit: int

    def __post_init__(self) -> None:
        _check_unit("Reshard.unit", self.unit)


UnshardAction = Union[Gather, AwaitGather, Reshard]
"""The closed union of schedule actions. Every consumer ``match``es on it and ends with
``case _: assert_never(action)``."""


def action_name(action: UnshardAction) -> str:
    """``gather``, ``await`` or ``reshard``."""
    match action:
        case Gather():
            return "gather"
        case AwaitGather():
            return "await"
        case Reshard():
            return "reshard"
        case _:
            assert_never(action)


def _check_order(name: str, order: object, units: int) -> None:
    if not isinstance(order, tuple):
        raise TypeError(f"{name}: expected a tuple of unit indices, got {order!r}")
    for unit in order:
        if not isinstance(unit, int) or isinstance(unit, bool) or not 0 <= unit < units:
            raise ValueError(f"{name}: expected unit indices in 0..{units - 1}, got {unit!r} in {order!r}")
    if len(set(order)) != len(order):
        raise ValueError(f"{name}: every unit may appear once, got {order!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class UnshardRequest:
    """What one iteration's all-gather schedule depends on: the recorded orders and the policy."""

    units: int
    """How many FSDP units the tree has; unit indices are ``0 .. units - 1``."""
    root: int
    """The root unit: it keeps its unsharded parameter from forward to backward (FSDP1)."""
    forward_order: tuple[int, ...]
    """Units in the order their forward ran on the recorded iteration; empty when nothing is
    recorded yet. Units that did not run are absent."""
    backward_order: tuple[int, ...]
    """Units in the order their pre-backward hook fired on the recorded iteration; may be empty."""
    reshard_after_forward: bool
    """``FULL_SHARD``/``HYBRID_SHARD``: non-root units free their unsharded parameter after forward."""
    plan_reshards: bool
    """Each unit's post-backward plan frees its unsharded parameter in the hook
    (``Plan.should_free_in_backward``). The schedule never does this itself; ``check_unshard``
    models it at each post-backward."""
    reshard_at_end_of_backward: bool
    """What is still gathered when backward ends is freed then
    (``ShardingStrategy.reshards_after_backward``); otherwise it stays gathered for the next
    accumulation step (the ZeRO-2 strategies inside ``no_sync``)."""
    backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE
    """When the next unit's all-gather is issued in backward; None: in its own pre-backward hook."""
    forward_prefetch: bool = False
    """Issue the next unit's all-gather in each unit's pre-forward, after its own."""
    forward_prefetches: tuple[tuple[int, ...], ...] = ()
    """Per unit: the units its pre-forward prefetches, in order, after its own all-gather has
    landed (``fully_shard``'s ``set_modules_to_forward_prefetch``); empty: ``forward_prefetch``
    (FSDP1: the next unit in ``forward_order``)."""
    backward_prefetches: tuple[tuple[int, ...], ...] = ()
    """Per unit: the units its pre-backward prefetches, in order, after its own
    (``set_modules_to_backward_prefetch``); a unit with none, or an empty tuple overall, prefetches
    as ``backward_prefetch`` says."""
    forward_reshards: tuple[bool, ...] = ()
    """Per unit: whether it frees its unsharded parameter after its forward, as ``fully_shard``
    gives it (each unit has a ``reshard_after_forward`` of its own, and the root may reshard too);
    empty: FSDP1's rule (``reshards_after_forward``)."""
    backward_reshards: tuple[bool, ...] = ()
    """Per unit: whether its post-backward plan frees its unsharded parameter, and the end of
    backward what is still gathered (``fully_shard``'s ``reshard_after_backward``); empty:
    ``plan_reshards`` and ``reshard_at_end_of_backward`` for every unit."""
    backward_gathers: tuple[bool, ...] = ()
    """Per unit: whether backward gathers it (False: ``fully_shard``'s
    ``set_unshard_in_backward(False)``, backward reads none of its parameters); empty: all do."""

    def __post_init__(self) -> None:
        if not isinstance(self.units, int) or isinstance(self.units, bool):
            raise TypeError(f"units: expected an int, got {self.units!r}")
        if self.units < 1:
            raise ValueError(f"units: expected >= 1, got {self.units}")
        if not isinstance(self.root, int) or isinstance(self.root, bool):
            raise TypeError(f"root: expected an int, got {self.root!r}")
        if not 0 <= self.root < self.units:
            raise ValueError(f"root: expected 0 <= root < units={self.units}, got {self.root}")
        _check_order("forward_order", self.forward_order, self.units)
        _check_order("backward_order", self.backward_order, self.units)
        for name in ("reshard_after_forward", "plan_reshards", "reshard_at_end_of_backward", "forward_prefetch"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(f"{name}: expected a bool, got {value!r}")
        if self.backward_prefetch is not None and not isinstance(self.backward_prefetch, BackwardPrefetch):
            raise TypeError(
                "backward_prefetch: expected None or a BackwardPrefetch (BACKWARD_PRE, "
                f"BACKWARD_POST), got {self.backward_prefetch!r}"
            )
        for name in ("forward_prefetches", "backward_prefetches"):
            lists = getattr(self, name)
            if not isinstance(lists, tuple) or not all(isinstance(t, tuple) for t in lists):
                raise TypeError(f"{name}: expected a tuple of unit tuples, one per unit, got {lists!r}")
            if lists and len(lists) != self.units:
                raise ValueError(f"{name}: expected one tuple per unit ({self.units}), got {len(lists)}")
            for unit, targets in enumerate(lists):
                _check_order(f"{name}[{unit}]", targets, self.units)
                if unit in targets:
                    raise ValueError(f"{name}[{unit}]: a unit cannot prefetch itself, got {targets!r}")
        for name in ("forward_reshards", "backward_reshards", "backward_gathers"):
            given = getattr(self, name)
            if not isinstance(given, tuple) or not all(isinstance(v, bool) for v in given):
                raise TypeError(f"{name}: expected a tuple of bools, one per unit, got {given!r}")
            if given and len(given) != self.units:
                raise ValueError(f"{name}: expected one bool per unit ({self.units}), got {len(given)}")

    @classmethod
    def chain(
        cls,
        units: int,
        *,
        reshard_after_forward: bool,
        plan_reshards: bool,
        reshard_at_end_of_backward: bool | None = None,
        backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE,
        forward_prefetch: bool = False,
    ) -> UnshardRequest:
        """A sequential model of ``units`` units as nested FSDP records it: the root (unit 0) wraps
        units ``1 .. units - 1``, which run forward in order. The root's pre-backward hook fires
        first (its output is the loss's input), then the others' in reverse: ``0, n-1, ..., 1``.
        ``reshard_at_end_of_backward`` defaults to ``plan_reshards``."""
        return cls(
            units=units,
            root=0,
            forward_order=tuple(range(units)),
            backward_order=(0, *range(units - 1, 0, -1)),
            reshard_after_forward=reshard_after_forward,
            plan_reshards=plan_reshards,
            reshard_at_end_of_backward=plan_reshards
            if reshard_at_end_of_backward is None
            else reshard_at_end_of_backward,
            backward_prefetch=backward_prefetch,
            forward_prefetch=forward_prefetch,
        )

    @property
    def events(self) -> tuple[HookEvent, ...]:
        """The recorded iteration's hooks in the order they fire, as ``check_unshard`` simulates
        them: forward in ``forward_order``, each unit's post-forward right after its pre-forward
        except the root's, which comes after every other forward; then pre-backward in
        ``backward_order``, each unit's post-backward right after its pre-backward except the
        root's, which comes last."""
        out: list[HookEvent] = []
        for pre, post, order in (
            (Event.PRE_FORWARD, Event.POST_FORWARD, self.forward_order),
            (Event.PRE_BACKWARD, Event.POST_BACKWARD, self.backward_order),
        ):
            for unit in order:
                out.append(HookEvent(pre, unit))
                if unit != self.root:
                    out.append(HookEvent(post, unit))
            if self.root in order:
                out.append(HookEvent(post, self.root))
        return tuple(out)

    @property
    def prefetch_depth(self) -> int:
        """How many units a hook may leave gathered ahead of their use: one, or the longest
        explicit prefetch list (``check_unshard``'s ``PREFETCH_DEPTH``)."""
        return max((len(t) for t in (*self.forward_prefetches, *self.backward_prefetches)), default=1) or 1

    def reshards_after_forward(self, unit: int) -> bool:
        """Whether ``unit`` frees its unsharded parameter after its forward: ``forward_reshards``
        where given, else ``reshard_after_forward`` for every unit but the root (FSDP1). The one
        answer the planner, the verifier and the renderings read."""
        if self.forward_reshards:
            return self.forward_reshards[unit]
        return self.reshard_after_forward and unit != self.root

    def plan_reshards_unit(self, unit: int) -> bool:
        """Whether ``unit``'s post-backward plan frees its unsharded parameter: ``backward_reshards``
        where given, else ``plan_reshards``."""
        return self.backward_reshards[unit] if self.backward_reshards else self.plan_reshards

    def reshards_at_end_of_backward(self, unit: int) -> bool:
        """Whether the end of backward frees ``unit``'s unsharded parameter if it is still gathered:
        ``backward_reshards`` where given, else ``reshard_at_end_of_backward``."""
        return self.backward_reshards[unit] if self.backward_reshards else self.reshard_at_end_of_backward

    def gathers_for_backward(self, unit: int) -> bool:
        """Whether backward gathers ``unit`` (``backward_gathers``; all do where it is empty)."""
        return self.backward_gathers[unit] if self.backward_gathers else True

    @property
    def kept_after_forward(self) -> frozenset[int]:
        """The units still gathered when backward starts: those that ran forward and do not reshard
        after it (``reshards_after_forward``)."""
        return frozenset(u for u in self.forward_order if not self.reshards_after_forward(u))

    def on_demand(self, event: Event, unit: int) -> tuple[UnshardAction, ...]:
        """The actions for a hook the record does not cover: gather and wait right before use
        (not for a backward that does not gather the unit), then the unit's explicit prefetch
        list, which needs no record (a ``Gather`` of a unit gathered or in flight does nothing);
        reshard after forward as ``reshards_after_forward`` says; nothing after backward."""
        match event:
            case Event.PRE_FORWARD:
                listed = self.forward_prefetches[unit] if self.forward_prefetches else ()
                return (Gather(unit=unit), AwaitGather(unit=unit), *(Gather(unit=t) for t in listed))
            case Event.PRE_BACKWARD:
                listed = self.backward_prefetches[unit] if self.backward_prefetches else ()
                own = (Gather(unit=unit), AwaitGather(unit=unit)) if self.gathers_for_backward(unit) else ()
                return (*own, *(Gather(unit=t) for t in listed if self.gathers_for_backward(t)))
            case Event.POST_FORWARD:
                return (Reshard(unit=unit),) if self.reshards_after_forward(unit) else ()
            case Event.POST_BACKWARD | Event.END_FORWARD | Event.END_BACKWARD:
                return ()
            case _:
                assert_never(event)


@dataclass(frozen=True, slots=True, kw_only=True)
class UnshardStep:
    """The actions to run, in order, when ``event`` fires for ``unit``."""

    event: Event
    unit: int
    actions: tuple[UnshardAction, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.event, Event):
            raise TypeError(f"event: expected an Event, got {self.event!r}")
        _check_unit("unit", self.unit)
        if not isinstance(self.actions, tuple) or not all(
            isinstance(a, (Gather, AwaitGather, Reshard)) for a in self.actions
        ):
            raise TypeError(f"actions: expected a tuple of Gather, AwaitGather and Reshard, got {self.actions!r}")


@dataclass(frozen=True, slots=True, kw_only=True)
class UnshardSchedule:
    """One iteration's all-gather schedule: a step per recorded hook event.

    Steps name only events of ``request.events``, each at most once, and units below
    ``request.units`` (checked on construction). ``table`` answers every (event, unit), falling
    back to ``request.on_demand`` where no step is given; ``actions`` is its checked lookup.
    """

    request: UnshardRequest
    steps: tuple[UnshardStep, ...]
    table: Mapping[HookEvent, tuple[UnshardAction, ...]] = field(init=False, repr=False, compare=False)
    """What to run when each hook event fires, for every event of every unit (read-only)."""

    def __post_init__(self) -> None:
        r = self.request
        if not isinstance(r, UnshardRequest):
            raise TypeError(f"request: expected an UnshardRequest, got {type(r).__name__}")
        if not isinstance(self.steps, tuple) or not all(isinstance(s, UnshardStep) for s in self.steps):
            raise TypeError(f"steps: expected a tuple of UnshardStep, got {self.steps!r}")
        recorded = set(r.events)
        table = {HookEvent(e, u): r.on_demand(e, u) for u in range(r.units) for e in Event}
        seen: set[HookEvent] = set()
        for step in self.steps:
            key = HookEvent(step.event, step.unit)
            where = f"steps: {step.event.value} of unit {step.unit}"
            if key not in recorded:
                raise ValueError(f"{where} is not an event of the recorded orders")
            if key in seen:
                raise ValueError(f"{where} appears twice")
            seen.add(key)
            for action in step.actions:
                if action.unit >= r.units:
                    raise ValueError(f"{where}: {action_name(action)} of unit {action.unit}, but units={r.units}")
            table[key] = step.actions
        object.__setattr__(self, "table", MappingProxyType(table))

    def actions(self, event: Event, unit: int) -> tuple[UnshardAction, ...]:
        """What to run when ``event`` fires for ``unit``: the step's actions, or the on-demand
        ones. Constant time."""
        try:
            return self.table[HookEvent(event, unit)]
        except KeyError:
            raise ValueError(
                f"unit: expected 0 <= unit < {self.request.units} and an Event, got {event!r} of unit {unit!r}"
            ) from None


def plan_unshard(request: UnshardRequest) -> UnshardSchedule:
    """The all-gather schedule FSDP runs for ``request``, one step per recorded hook event.

    - pre-forward of ``u``: ``Gather(u)`` unless it was prefetched, ``AwaitGather(u)``; then
      ``Gather`` of each unit ``forward_prefetches[u]`` lists, or with ``forward_prefetch`` of
      the next unit in ``forward_order``.
    - post-forward of ``u``: ``Reshard(u)`` when ``request.reshards_after_forward(u)`` (FSDP1:
      ``reshard_after_forward`` and ``u`` is not the root).
    - pre-backward of ``u``: nothing for a unit still gathered from forward, or that backward does
      not gather (``gathers_for_backward``); otherwise ``Gather(u)`` unless it was prefetched, and
      ``AwaitGather(u)``. Then ``Gather`` of each unit ``backward_prefetches[u]`` lists, or with
      ``BACKWARD_PRE`` of the next unit in ``backward_order``, where backward gathers it.
    - post-backward of ``u``: the plan reshards ``u`` first (``plan_reshards_unit``); with
      ``BACKWARD_POST``, ``Gather`` of the next unit in ``backward_order``, unless ``u`` is the
      root (its post-backward fires last) or lists prefetches of its own.

    A prefetch gathers only a unit that is sharded at that point (FSDP1's
    ``_needs_pre_backward_unshard``; FSDP2's ``unshard`` is a no-op otherwise): a unit still
    gathered from forward, or already in flight, is not gathered again. The planner walks the
    recorded events keeping each unit's state, as ``check_unshard`` does.
    """
    r = request
    forward_next = dict(zip(r.forward_order, r.forward_order[1:])) if r.forward_prefetch else {}
    backward_next = dict(zip(r.backward_order, r.backward_order[1:]))
    flight: set[int] = set()
    gathered: set[int] = set()

    def forward_targets(unit: int) -> tuple[int, ...]:
        if r.forward_prefetches:
            return r.forward_prefetches[unit]
        return (forward_next[unit],) if unit in forward_next else ()

    def backward_targets(unit: int, when: BackwardPrefetch) -> tuple[int, ...]:
        explicit = r.backward_prefetches[unit] if r.backward_prefetches else ()
        if explicit:
            return (
                tuple(t for t in explicit if r.gathers_for_backward(t)) if when is BackwardPrefetch.BACKWARD_PRE else ()
            )
        if r.backward_prefetch is not when or unit not in backward_next:
            return ()
        if when is BackwardPrefetch.BACKWARD_POST and unit == r.root:
            return ()
        following = backward_next[unit]
        return (following,) if r.gathers_for_backward(following) else ()

    def gather(unit: int) -> tuple[UnshardAction, ...]:
        if unit in flight or unit in gathered:
            return ()
        flight.add(unit)
        return (Gather(unit=unit),)

    def own(unit: int) -> tuple[UnshardAction, ...]:
        issued = gather(unit)
        if unit in gathered:
            return issued
        flight.discard(unit)
        gathered.add(unit)
        return (*issued, AwaitGather(unit=unit))

    def prefetch(targets: tuple[int, ...]) -> tuple[UnshardAction, ...]:
        return tuple(a for t in targets for a in gather(t))

    def actions(event: Event, unit: int) -> tuple[UnshardAction, ...]:
        match event:
            case Event.PRE_FORWARD:
                return own(unit) + prefetch(forward_targets(unit))
            case Event.POST_FORWARD:
                if r.reshards_after_forward(unit):
                    gathered.discard(unit)
                return r.on_demand(event, unit)
            case Event.PRE_BACKWARD:
                mine = own(unit) if r.gathers_for_backward(unit) else ()
                return mine + prefetch(backward_targets(unit, BackwardPrefetch.BACKWARD_PRE))
            case Event.POST_BACKWARD:
                if r.plan_reshards_unit(unit):
                    gathered.discard(unit)
                return prefetch(backward_targets(unit, BackwardPrefetch.BACKWARD_POST))
            case Event.END_FORWARD | Event.END_BACKWARD:
                return ()
            case _:
                assert_never(event)

    steps = tuple(UnshardStep(event=e.event, unit=e.unit, actions=actions(e.event, e.unit)) for e in r.events)
    return UnshardSchedule(request=r, steps=steps)


def unshard_request(
    *,
    units: int,
    root: int,
    forward_order: tuple[int, ...],
    backward_order: tuple[int, ...],
    strategy: ShardingStrategy,
    low_precision: bool,
    sync_gradients: bool,
    backward_prefetch: BackwardPrefetch | None,
    forward_prefetch: bool,
) -> UnshardRequest:
    """The request for one iteration of a tree with ``strategy``, as the shell runs it: the one
    builder the runtime (``fsdp_shell.units.unshard``), the memory model, the simulator and
    ``fsdp-plan`` all use. ``low_precision``: a unit computes in a dtype of its own (mixed
    precision); ``sync_gradients``: the iteration is not inside ``no_sync``."""
    return UnshardRequest(
        units=units,
        root=root,
        forward_order=forward_order,
        backward_order=backward_order,
        reshard_after_forward=strategy.reshards_after_forward_with(low_precision),
        plan_reshards=strategy.plan_reshards(low_precision=low_precision, sync_gradients=sync_gradients),
        reshard_at_end_of_backward=strategy.reshards_after_backward(sync_gradients),
        backward_prefetch=backward_prefetch,
        forward_prefetch=forward_prefetch,
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class PerUnitGathers:
    """What each ``fully_shard`` unit's own settings make of its all-gathers, by unit index:
    whether it reshards after forward (``reshard_after_forward``; an int counts as True), whether
    its post-backward and the end of backward reshard it (``reshard_after_backward``; empty: all
    do), whether backward gathers it (``set_unshard_in_backward``; empty: all), and the units
    its forward and backward prefetch (``set_modules_to_forward_prefetch``,
    ``set_modules_to_backward_prefetch``; empty: none). The runtime
    (``fsdp_shell.fsdp2.gathers``) and the models (memory, step time) take the schedule from it
    through ``per_param_unshard_request``."""

    forward_reshards: tuple[bool, ...]
    backward_reshards: tuple[bool, ...] = ()
    backward_gathers: tuple[bool, ...] = ()
    forward_prefetches: tuple[tuple[int, ...], ...] = ()
    backward_prefetches: tuple[tuple[int, ...], ...] = ()


def per_param_unshard_request(
    *,
    units: int,
    root: int,
    forward_order: tuple[int, ...],
    backward_order: tuple[int, ...],
    gathers: PerUnitGathers,
) -> UnshardRequest:
    """The request for one iteration of ``fully_shard`` units, as the shell runs it
    (``fsdp_shell.fsdp2.gathers``) and the memory and step-time models predict it: each unit's
    own settings (``gathers``), no implicit prefetch (only the explicit lists), every
    post-backward plan resharding its unit unless ``gathers.backward_reshards`` says otherwise.
    ``ValueError`` where ``gathers`` does not have one entry per unit."""
    return UnshardRequest(
        units=units,
        root=root,
        forward_order=forward_order,
        backward_order=backward_order,
        reshard_after_forward=True,
        plan_reshards=True,
        reshard_at_end_of_backward=True,
        backward_prefetch=None,
        forward_prefetches=gathers.forward_prefetches,
        backward_prefetches=gathers.backward_prefetches,
        forward_reshards=gathers.forward_reshards,
        backward_reshards=gathers.backward_reshards,
        backward_gathers=gathers.backward_gathers,
    )
