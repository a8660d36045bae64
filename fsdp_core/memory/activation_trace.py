"""Autograd's side of a training step, the one input the plans cannot give: everything the
model's own ops hold (inputs, activations saved for backward, the gradients flowing back, each
unit's new unsharded gradient until its post-backward hook takes it), as an ``ActivationTrace``:
the bytes at every FSDP hook and at the step's phase boundaries (``Mark``), and the highest
between them. The shell records one from a forward and backward under ``FakeTensorMode``
(``fsdp_shell.predict``); ``ActivationTrace.chain`` makes one from bytes given per unit.
``fsdp_core.memory.model_memory`` walks a step through it and FSDP's side."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import assert_never

from fsdp_core.spec.events import Event, HookEvent
from fsdp_core.unshard.schedule import UnshardRequest

__all__ = [
    "ActivationTrace",
    "Mark",
    "TracePoint",
]


class Mark(enum.Enum):
    """A boundary of the user's training step that is no FSDP hook."""

    FORWARD_START = "forward_start"
    """The forward phase begins: nothing of this step is made yet (its inputs neither)."""
    BACKWARD_START = "backward_start"
    """The loss is made; ``backward()`` is called."""
    BACKWARD_END = "backward_end"
    """``backward()`` has returned."""
    STEP_END = "step_end"
    """The step's tensors are dropped (the loss); what is left outlives the step."""


@dataclass(frozen=True, slots=True, kw_only=True)
class TracePoint:
    """Autograd's side at one FSDP hook or step boundary.

    ``live``: the bytes when it happens, before FSDP acts; ``taken``: at a post-backward hook,
    the bytes of the new unsharded gradient the hook takes (counted in ``live``, gone after it);
    ``peak``: the highest from when the hook returned until the next point; ``flops``: the work
    done until then (``ActivationTrace.unit_flops``)."""

    at: HookEvent | Mark
    live: int
    peak: int
    taken: int = 0
    flops: int = 0
    """The floating-point operations the model's ops did from this point until the next."""

    def __post_init__(self) -> None:
        if not isinstance(self.at, (HookEvent, Mark)):
            raise TypeError(f"at: expected a HookEvent or a Mark, got {self.at!r}")
        for name in ("live", "peak", "taken", "flops"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name}: expected an int >= 0 (bytes), got {value!r}")
        if self.taken > self.live:
            raise ValueError(f"taken: {self.taken} B is more than the {self.live} B live when the hook fires")
        if self.taken and not (isinstance(self.at, HookEvent) and self.at.event is Event.POST_BACKWARD):
            raise ValueError("taken: only a post-backward hook takes a gradient")


_MARK_ORDER = (Mark.FORWARD_START, Mark.BACKWARD_START, Mark.BACKWARD_END, Mark.STEP_END)


@dataclass(frozen=True, slots=True, kw_only=True)
class ActivationTrace:
    """Autograd's side of one forward-backward (module docstring): the marks in their order,
    ``FORWARD_START`` first and ``STEP_END`` last, each once, and the hooks between them."""

    points: tuple[TracePoint, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.points, tuple) or not all(isinstance(p, TracePoint) for p in self.points):
            raise TypeError(f"points: expected a tuple of TracePoint, got {self.points!r}")
        marks = tuple(p.at for p in self.points if isinstance(p.at, Mark))
        ends = (self.points[0].at, self.points[-1].at)
        if marks != _MARK_ORDER or ends != (Mark.FORWARD_START, Mark.STEP_END):
            raise ValueError(
                "points: expected the marks forward_start (first), backward_start, backward_end and step_end "
                f"(last) once each, got {[m.value for m in marks]}"
            )

    def _units(self, event: Event) -> tuple[int, ...]:
        seen: dict[int, None] = {}
        for p in self.points:
            if isinstance(p.at, HookEvent) and p.at.event is event:
                seen.setdefault(p.at.unit, None)
        return tuple(seen)

    @property
    def forward_order(self) -> tuple[int, ...]:
        """Units in the order their forward first ran (as the shell records it)."""
        return self._units(Event.PRE_FORWARD)

    @property
    def backward_order(self) -> tuple[int, ...]:
        """Units in the order their pre-backward hook first fired."""
        return self._units(Event.PRE_BACKWARD)

    @property
    def post_backward_order(self) -> tuple[int, ...]:
        """Units in the order their post-backward hook fired."""
        return tuple(
            p.at.unit for p in self.points if isinstance(p.at, HookEvent) and p.at.event is Event.POST_BACKWARD
        )

    def unit_flops(self, units: int, root: int) -> tuple[tuple[int, int], ...]:
        """Each unit's forward and backward FLOPs (``unit_values`` of the points' ``flops``)."""
        values = self.unit_values([p.flops for p in self.points], units, root)
        return tuple((int(f), int(b)) for f, b in values)

    def unit_values(self, values: Sequence[float], units: int, root: int) -> tuple[tuple[float, float], ...]:
        """Each unit's forward and backward share of ``values`` (one per point, from it to the next:
        FLOPs, seconds): in forward, what runs between a unit's pre-forward and post-forward
        hooks outside units nested in it; in backward, what runs after a unit's pre-backward hook
        until its post-backward one. The rest (the inputs, the loss, the root's own modules,
        what runs between units) is the root's."""
        if len(values) != len(self.points):
            raise ValueError(f"values: expected one per point ({len(self.points)}), got {len(values)}")
        forward, backward = [0.0] * units, [0.0] * units
        stack: list[int] = []
        running: list[int] = []
        in_backward = False
        for p, value in zip(self.points, values):
            at = p.at
            if at is Mark.BACKWARD_START:
                in_backward = True
            elif isinstance(at, HookEvent):
                event, unit = at
                match event:
                    case Event.PRE_FORWARD:
                        stack.append(unit)
                    case Event.POST_FORWARD:
                        if unit in stack:
                            stack.remove(unit)
                    case Event.PRE_BACKWARD:
                        running.append(unit)
                    case Event.POST_BACKWARD:
                        if unit in running:
                            running.remove(unit)
                    case Event.END_FORWARD | Event.END_BACKWARD:
                        pass
                    case _:
                        assert_never(event)
            if in_backward:
                backward[running[-1] if running else root] += value
            else:
                forward[stack[-1] if stack else root] += value
        return tuple(zip(forward, backward))

    @classmethod
    def chain(
        cls, request: UnshardRequest, saved: Sequence[int], grads: Sequence[int], *, inputs: int = 0
    ) -> ActivationTrace:
        """A trace from bytes given per unit rather than recorded: ``saved[u]`` stay from unit
        ``u``'s forward to its post-backward, ``grads[u]`` is its new unsharded gradient (0: it
        gets none), ``inputs`` live from the step's start to its end; the hooks fire in
        ``request.events``' order (the root's forward around the others'). Transients inside a
        unit's forward or backward are not in it: a lower bound where they matter."""
        if len(saved) != request.units or len(grads) != request.units:
            raise ValueError(f"saved, grads: expected one figure per unit ({request.units})")
        live = inputs
        points = [TracePoint(at=Mark.FORWARD_START, live=0, peak=inputs)]
        for hook in request.events:
            event, unit = hook
            taken = 0
            match event:
                case Event.POST_FORWARD:
                    live += saved[unit]
                case Event.POST_BACKWARD:
                    if not grads[unit]:  # a frozen unit: no hook, its activations go all the same
                        live -= saved[unit]
                        continue
                    taken = grads[unit]
                    live += taken
                case Event.PRE_FORWARD | Event.PRE_BACKWARD | Event.END_FORWARD | Event.END_BACKWARD:
                    pass
                case _:
                    assert_never(event)
            if event is Event.PRE_BACKWARD and not any(p.at is Mark.BACKWARD_START for p in points):
                points.append(TracePoint(at=Mark.BACKWARD_START, live=live, peak=live))
            after = live - taken - (saved[unit] if event is Event.POST_BACKWARD else 0)
            points.append(TracePoint(at=hook, live=live, peak=after, taken=taken))
            live = after
        if not any(p.at is Mark.BACKWARD_START for p in points):
            points.append(TracePoint(at=Mark.BACKWARD_START, live=live, peak=live))
        points.append(TracePoint(at=HookEvent(Event.END_BACKWARD, -1), live=live, peak=live))
        points += [TracePoint(at=Mark.BACKWARD_END, live=live, peak=live), TracePoint(at=Mark.STEP_END, live=0, peak=0)]
        return cls(points=tuple(points))
