"""fsdp_shell: the imperative side of fsdp.

``FullyShardedDataParallel`` (alias ``FSDP``, in ``fsdp_shell.fsdp``) is the ``nn.Module``
wrapper: FSDP1's constructor and public API. Its hooks (``fsdp_shell.hooks``) run the plans of
``fsdp_core`` on real process groups (NCCL on GPU, gloo on CPU) and autograd hooks through one
interpreter (``fsdp_shell.runtime``). The folders, one concern each:

- ``units``: one unit's flat parameter (flatten, shard, gather, views, carried gradients) and
  the all-gather schedule across units;
- ``runtime``: the interpreter, the device runtimes behind one protocol, the collectives and
  their log, process groups, and a world of ranks in one process (``inprocess``) on which
  ``simulate`` runs every rank's plan under the interpreter to check the numbers;
- ``state``: state dicts, optimizer state dicts, crash-safe checkpoints;
- ``safety``: the ranks' agreement before the first collective, the event sequencer for
  divergent paths, timeouts turned into errors that say where;
- ``fsdp2``: ``fully_shard`` and ``FSDPModule``, PyTorch's FSDP2 API, on the same plans,
  interpreter and runtimes;
- ``cli``: ``fsdp-plan``, ``fsdp-sim`` (neither imports the wrapper) and the local launcher;
  ``cluster``: an emulated two-node cluster on one machine (network namespaces, as root);
  ``demo``: ``fsdp-demo``.

``fsdp_shell.comm_hooks`` has built-in communication hooks that also work on CPU. The names
below are imported on first use, so ``fsdp_shell.cli`` loads none of the training runtime.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from fsdp_core import CPUOffload, MixedPrecision, ShardingStrategy

if TYPE_CHECKING:
    from fsdp_shell.fsdp import FSDP, FullyShardedDataParallel
    from fsdp_shell.fsdp2.api import FSDPModule, fully_shard, register_fsdp_forward_method
    from fsdp_shell.state.state_dict import StateDictSettings, StateDictType

__all__ = [
    "FSDP",
    "CPUOffload",
    "FSDPModule",
    "FullyShardedDataParallel",
    "MixedPrecision",
    "ShardingStrategy",
    "StateDictSettings",
    "StateDictType",
    "fully_shard",
    "register_fsdp_forward_method",
]

_LAZY = {
    "FSDP": "fsdp_shell.fsdp",
    "FullyShardedDataParallel": "fsdp_shell.fsdp",
    "StateDictSettings": "fsdp_shell.state.state_dict",
    "StateDictType": "fsdp_shell.state.state_dict",
    "FSDPModule": "fsdp_shell.fsdp2.api",
    "fully_shard": "fsdp_shell.fsdp2.api",
    "register_fsdp_forward_method": "fsdp_shell.fsdp2.api",
}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'fsdp_shell' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
