"""What a rank's memory holds, measured: ``live.LiveBytes``, exact live tensor-storage bytes by
phase (the yardstick the memory prediction is checked against).

Beside it, imported by their own paths (importing this package loads no wrapper): a whole
training configuration as one value and what builds, wraps and trains it (``workload``), and
its bytes by phase trained on a gloo rank, ours or FSDP1 (``measure``).
"""

from fsdp_shell.memory.live import LiveBytes, Window

__all__ = ["LiveBytes", "Window"]
