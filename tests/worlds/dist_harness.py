"""Real gloo worlds on loopback for the tests: ``fsdp_shell.cli.launch`` (spawn, hard timeout)."""

from fsdp_shell.cli.launch import free_port, run_world

__all__ = ["free_port", "run_world"]
