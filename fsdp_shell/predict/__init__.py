"""Predict before launch: a whole model's memory per rank, from the plans that will run.

``predict_memory`` takes a model (built on the meta device), FSDP's arguments and a world,
and returns every rank's bytes by phase and category, with no process group
(``fsdp_core.memory.model_memory`` does the arithmetic; ``record_trace`` gives autograd's side
from a ``FakeTensorMode`` step). ``fsdp-plan --model SPEC`` prints it.
"""

from fsdp_shell.predict.model import Prediction, predict_memory
from fsdp_shell.predict.trace import StepFn, TraceUnit, record_trace

__all__ = ["Prediction", "StepFn", "TraceUnit", "predict_memory", "record_trace"]
