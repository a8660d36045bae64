"""fsdp_shell: the imperative side of fsdp.

``FullyShardedDataParallel`` (alias ``FSDP``) is the ``nn.Module`` wrapper; it runs the plans of
``fsdp_core`` on real process groups (NCCL on GPU, gloo on CPU), streams and autograd hooks
through one interpreter (``fsdp_shell.interpreter``). ``fsdp_shell.comm_hooks`` has built-in
communication hooks that also work on CPU; ``fsdp_shell.simulated_world`` runs a plan for
every rank of a simulated world in one process; ``fsdp-plan`` is ``fsdp_shell.plan_cli``.
"""

from fsdp_core import CPUOffload, MixedPrecision, ShardingStrategy
from fsdp_shell.fsdp import FSDP, FullyShardedDataParallel
from fsdp_shell.state_dict import StateDictSettings, StateDictType

__all__ = ["CPUOffload", "FSDP", "FullyShardedDataParallel", "MixedPrecision", "ShardingStrategy",
           "StateDictSettings", "StateDictType"]
