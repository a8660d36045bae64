"""What a rank's memory holds, measured: ``live.LiveBytes``, exact live tensor-storage bytes by
phase (the yardstick the memory prediction is checked against)."""

from fsdp_shell.memory.live import LiveBytes, Window

__all__ = ["LiveBytes", "Window"]
