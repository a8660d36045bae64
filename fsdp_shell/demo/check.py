"""``fsdp-demo --check``: every step of the run against what data parallelism defines, each within
a bound derived from the plans that ran, so that rounding cannot compound from step to step.

At every optimizer step, from the parameters FSDP holds at its start:

1. **Gradients.** Each rank also runs its micro-batches through a plain copy of the model (no
   FSDP) holding the same parameters, in the compute dtype (``--mixed-precision``: the parameters
   rounded to it, as FSDP gathers them). Their gradients are summed exactly (float64, over the
   micro-batches and the ranks) and divided by the world size: the exact average. FSDP's reduced
   gradient may differ from it only by rounding: ``fsdp_core.plan.rounding`` follows each term
   through the ops of the plans that ran for the unit (casts, divisions, accumulation, the
   collectives over their groups) and bounds the difference of every element by
   ``(exp(rho) - 1) * mean |terms| + exp(rho) * alpha``, the float64 sums' own rounding added.
2. **Clipping** (``--clip``). The norm ``clip_grad_norm_`` returns against the float64 norm of the
   gathered gradient (a sum of ``N`` squares in float32 in any order: ``N + 16`` roundings), and
   the clipped gradient against the gradient times the coefficient that norm gives.
3. **Updates.** ``torch.optim.AdamW`` steps a plain copy of the parameters with FSDP's gradient;
   its result against FSDP's next parameters. AdamW is elementwise, so only its own rounding can
   differ: ``2u`` of the parameter and, of the update, ``8u`` plus the rounding its moment
   estimates can carry from step to step, at most ``u / (1 - beta)`` each.

The check assumes that the same forward and backward on the same values gives the same gradient
(true on the CPU; on a GPU, ``--check`` asks torch for deterministic algorithms). It reports, for
each comparison, the largest ``|difference| / bound`` of any element at any step (at most 1:
within the bound) and where it was.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_core import InputRole, Plan
from fsdp_core.plan.rounding import Rounding, step_rounding, unit_roundoff
from fsdp_shell.demo import models
from fsdp_shell.demo.config import DemoConfig
from fsdp_shell.demo.model import lm_loss
from fsdp_shell.fsdp import FullyShardedDataParallel
from fsdp_shell.fsdp2.state import FSDPState, state_of
from fsdp_shell.units.flat_param import FlatParamHandle

__all__ = ["CheckReport", "StepCheck", "Worst"]

_F32_U = unit_roundoff(torch.float32)
_F64_U = unit_roundoff(torch.float64)


@dataclass(frozen=True, slots=True)
class Worst:
    """The largest ``|difference| / bound`` of one comparison, and where it was."""

    ratio: float = 0.0
    step: int = 0
    name: str = ""
    difference: float = 0.0
    bound: float = 0.0

    def __str__(self) -> str:
        where = f" (step {self.step}, {self.name}: {self.difference:.3g} of {self.bound:.3g})" if self.name else ""
        return f"{self.ratio:.3g} of its bound{where}"


@dataclass
class CheckReport:
    """What ``--check`` found over the whole run (rank 0's)."""

    steps: int = 0
    gradients: Worst = field(default_factory=Worst)
    clipping: Worst | None = None
    updates: Worst = field(default_factory=Worst)

    @property
    def passed(self) -> bool:
        """Whether every comparison stayed within its bound."""
        found = [self.gradients, self.updates] + ([] if self.clipping is None else [self.clipping])
        return all(w.ratio <= 1.0 for w in found)

    def lines(self) -> list[str]:
        """The summary's rows: what was compared, how close it came to its bound."""
        rows = [f"gradients {self.gradients}", f"updates   {self.updates}"]
        if self.clipping is not None:
            rows.insert(1, f"clipping  {self.clipping}")
        verdict = "OK" if self.passed else "FAILED"
        return [f"{self.steps} steps, each from the same parameters: {verdict}", *rows]


def _worse(worst: Worst, step: int, name: str, difference: torch.Tensor, bound: torch.Tensor) -> Worst:
    """``worst``, or this comparison's largest ratio where it is larger (a difference where the
    bound is 0 is infinitely far)."""
    beyond = torch.where(difference > 0, math.inf, 0.0)
    ratio = torch.where(bound > 0, difference / bound.clamp_min(torch.finfo(bound.dtype).tiny), beyond)
    ratio = torch.nan_to_num(ratio, nan=math.inf)
    i = int(ratio.argmax())
    r = float(ratio.reshape(-1)[i])
    if r <= worst.ratio:
        return worst
    return Worst(r, step, name, float(difference.reshape(-1)[i]), float(bound.reshape(-1)[i]))


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A ``fully_shard`` parameter's or gradient's whole value (a collective over its mesh)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def _fully_shard_units(model: nn.Module) -> list[FSDPState]:
    """The ``fully_shard`` units of ``model`` that hold parameters, in module order."""
    out: list[FSDPState] = []
    for m in model.modules():
        s = state_of(m)
        if s is not None and s.group is not None and s not in out:
            out.append(s)
    return out


def _full_grads(h: FlatParamHandle) -> dict[str, torch.Tensor]:
    """Unit ``h``'s reduced gradient, whole, by original parameter name (a collective over the
    shard group): what the optimizer steps on, gathered."""
    local = h.sharded_grad_flat()
    if local is None:
        local = torch.zeros(h.shard_numel, dtype=h.orig_dtype, device=h.device)
    flat = h.gather_full(local.detach().to(device=h.device, dtype=h.orig_dtype))
    return {p.fqn: v for p, v in zip(h.params, h.full_views(flat))}


class StepCheck:
    """``--check`` on one rank: call ``begin`` at the start of each step, ``backward`` for each
    micro-batch's backward (it also runs the reference on the same rows), ``gradients`` after the
    last, ``clipped`` after ``clip_grad_norm_``, ``stepped`` after the optimizer step."""

    def __init__(self, cfg: DemoConfig, model: nn.Module, world: int, device: torch.device) -> None:
        self.cfg = cfg
        self.model = model
        self.world = world
        self.device = device
        self.units: dict[int, FlatParamHandle] = {}
        """Every FSDP1 unit that holds parameters, by unit index (the demo is the shell's own: it
        reads the units' handles and the plans they ran)."""
        self.states: list[FSDPState] = []
        """With ``fully_shard``: every unit that holds parameters (its state)."""
        if isinstance(model, FullyShardedDataParallel):
            self.units = {u: h for u, h in enumerate(model._tree.handles) if h is not None}
        else:
            self.states = _fully_shard_units(model)
            self.units = {}
        self._fqn = {id(p): n for n, p in model.named_parameters()}
        mixed = cfg.mixed()
        self.compute_dtype = torch.float32 if mixed is None or mixed.param_dtype is None else mixed.param_dtype
        with torch.random.fork_rng(devices=[]):
            plain, _ = models.build(cfg.model)
        self.reference = plain.to(device)
        for p in self.reference.parameters():
            p.data = p.data.to(self.compute_dtype)  # parameters only: FSDP1 leaves buffers alone
        self.named = list(self.reference.named_parameters())
        self.names = {id(p): n for n, p in self.named}
        self.report = CheckReport(clipping=None if cfg.clip is None else Worst())
        self._optimizer_copy: nn.Module | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._step = 0
        self._params: dict[str, torch.Tensor] = {}
        self._grads: dict[str, torch.Tensor] = {}
        self._sums: dict[str, torch.Tensor] = {}
        self._magnitudes: dict[str, torch.Tensor] = {}
        self._plans: dict[int, list[Plan]] = {}
        if self.device.type != "cpu":
            torch.use_deterministic_algorithms(True, warn_only=True)

    def _name(self, fqn: str) -> str:
        """The reference's name for FSDP's parameter ``fqn`` (a tied parameter has one name)."""
        return self.names[id(self.reference.get_parameter(fqn))]

    def _full_params(self) -> dict[str, torch.Tensor]:
        """Every unit's parameters, whole, by the reference's names (collectives)."""
        if self.states:
            return {self._name(n): _whole(p.detach()) for n, p in self.model.named_parameters()}
        return {self._name(fqn): v for h in self.units.values() for fqn, v in h.full_values().items()}

    def _unit_grads(self, unit: int) -> dict[str, torch.Tensor]:
        """Unit ``unit``'s reduced gradient, whole, by its parameters' names in the model (collectives)."""
        if self.states:
            group = self.states[unit].group
            assert group is not None
            out = {}
            for p in group.sharded:
                g = p.grad
                out[self._fqn[id(p)]] = torch.zeros(p.shape, dtype=p.dtype) if g is None else _whole(g.detach())
            return out
        return _full_grads(self.units[unit])

    def _unit_indices(self) -> list[int]:
        return list(range(len(self.states))) if self.states else list(self.units)

    def _full_grads(self) -> dict[str, torch.Tensor]:
        """Every unit's reduced gradient, whole, by the reference's names (collectives)."""
        return {self._name(fqn): g for u in self._unit_indices() for fqn, g in self._unit_grads(u).items()}

    def begin(self, step: int) -> None:
        """The step's parameters (gathered; the last step's result after the first) into the
        reference; nothing accumulated yet."""
        self._step = step + 1
        if not self._params:
            self._params = self._full_params()
        with torch.no_grad():
            for name, p in self.named:
                p.copy_(self._params[name])
        self._sums = {n: torch.zeros(p.shape, dtype=torch.float64, device=self.device) for n, p in self.named}
        self._magnitudes = {n: torch.zeros_like(t) for n, t in self._sums.items()}
        self._plans = {unit: [] for unit in self._unit_indices()}

    def backward(self, loss: torch.Tensor, tokens: torch.Tensor, targets: torch.Tensor) -> None:
        """FSDP's backward of ``loss`` (recording the plans each unit ran), then the reference's
        gradient of the same rows' loss, summed exactly."""
        if self.states:
            root = state_of(self.model)
            assert root is not None and root.ctx is not None
            runs = root.ctx.iteration.runs  # replaced at the end of backward: this one keeps the runs
            torch.autograd.backward(loss)
            unit_of = {id(s.group): u for u, s in enumerate(self.states)}
            for run in runs:
                unit = unit_of[id(run.owner)]
                self._plans[unit].append(self._as_rounded(unit, run.plan))
        else:
            assert isinstance(self.model, FullyShardedDataParallel)
            iteration = self.model._tree.iteration  # replaced at the end of backward: this one keeps the runs
            torch.autograd.backward(loss)
            for unit, run in iteration.runs:
                self._plans[unit].append(run.plan)
        self.reference.zero_grad(set_to_none=True)
        ref_loss = lm_loss(models.logits(self.reference, tokens, self.cfg.model.arch), targets) / self.cfg.grad_accum
        torch.autograd.backward(ref_loss)
        for name, p in self.named:
            if p.grad is not None:
                g = p.grad.double()
                self._sums[name] += g
                self._magnitudes[name] += g.abs()

    def _as_rounded(self, unit: int, plan: Plan) -> Plan:
        """The plan whose rounding is that of what ran: where ``fully_shard`` put the unsharded
        gradient kept from a ``no_sync`` backward back into ``.grad`` (kept in the compute dtype)
        and autograd added this backward's into it, the plan that adds them itself (its
        ``Accumulate`` in that dtype rounds as autograd's add does)."""
        done = self._plans[unit]
        pending = InputRole.PENDING_UNSHARDED
        if not done or done[-1].carried_out is not pending or pending in plan.consumed:
            return plan
        return self.states[unit].step_plan(frozenset(plan.consumed | {pending}))

    def gradients(self) -> None:
        """FSDP's reduced gradient of the step against the exact average (collectives)."""
        names = [n for n, _ in self.named]
        both = torch.cat([self._sums[n].reshape(-1) for n in names] + [self._magnitudes[n].reshape(-1) for n in names])
        dist.all_reduce(both)
        half = both.numel() // 2
        exact = self._unflatten(both[:half] / self.world, names)
        magnitude = self._unflatten(both[half:] / self.world, names)
        terms = self.world * self.cfg.grad_accum
        self._grads = {}
        for unit in self._unit_indices():
            plans = self._plans[unit]  # none: no gradient reached the unit, so the exact one must be 0
            bound = self._allowed(step_rounding(plans) if plans else Rounding(), terms)
            for fqn, g in self._unit_grads(unit).items():
                name = self._name(fqn)
                self._grads[name] = g
                diff = (g.double() - exact[name]).abs()
                allowed = bound.relative * magnitude[name] + math.exp(bound.roundoffs) * bound.underflow
                self.report.gradients = _worse(self.report.gradients, self._step, name, diff, allowed)

    @staticmethod
    def _allowed(fsdp: Rounding, terms: int) -> Rounding:
        """FSDP's rounding plus the exact sum's own: ``terms - 1`` float64 additions and a division."""
        return Rounding(fsdp.roundoffs + terms * _F64_U, fsdp.underflow)

    def _unflatten(self, flat: torch.Tensor, names: list[str]) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        offset = 0
        for name in names:
            shape = self._sums[name].shape
            n = math.prod(shape)
            out[name] = flat[offset : offset + n].view(shape)
            offset += n
        return out

    def clipped(self, norm: torch.Tensor) -> None:
        """``clip_grad_norm_``'s norm against the float64 norm of the gathered gradient, and the
        clipped gradient against the gradient times the coefficient of that norm (collectives)."""
        assert self.cfg.clip is not None and self.report.clipping is not None
        before = self._grads
        exact = torch.sqrt(sum((g.double() ** 2).sum() for g in before.values()))  # type: ignore[arg-type]  # a sum of tensors is a tensor
        count = sum(g.numel() for g in before.values())
        norm_bound = math.expm1((count + 16) * _F32_U) * exact
        worst = _worse(self.report.clipping, self._step, "total norm", (norm.double() - exact).abs(), norm_bound)
        coefficient = min(1.0, self.cfg.clip / (float(norm) + 1e-6))
        self._grads = self._full_grads()
        for name, g in self._grads.items():
            want = before[name].double() * coefficient
            worst = _worse(worst, self._step, name, (g.double() - want).abs(), math.expm1(4 * _F32_U) * want.abs())
        self.report.clipping = worst

    def stepped(self) -> None:
        """The optimizer's step against AdamW stepping a plain copy with the same gradient."""
        if self._optimizer_copy is None:
            with torch.random.fork_rng(devices=[]):
                plain, _ = models.build(self.cfg.model)
            self._optimizer_copy = plain.to(self.device)
            self._optimizer = torch.optim.AdamW(self._optimizer_copy.parameters(), lr=self.cfg.lr, weight_decay=0.0)
        assert self._optimizer is not None
        copy = dict(self._optimizer_copy.named_parameters())
        with torch.no_grad():
            for name, p in copy.items():
                p.copy_(self._params[name])
                p.grad = self._grads[name].to(p.dtype).clone()
        self._optimizer.step()
        after = self._full_params()
        beta1, beta2 = self._optimizer.param_groups[0]["betas"]
        carried = 8 + 1 / (1 - beta1) + 1 / (1 - beta2)
        worst = self.report.updates
        for name, p in copy.items():
            start, want = self._params[name].double(), p.detach().double()
            allowed = 2 * _F32_U * want.abs() + carried * _F32_U * (want - start).abs()
            worst = _worse(worst, self._step, name, (after[name].double() - want).abs(), allowed)
        self.report.updates = worst
        self.report.steps += 1
        self._params = after
