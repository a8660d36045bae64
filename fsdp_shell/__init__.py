"""fsdp_shell: the imperative side of fsdp.

It resolves the plans of ``fsdp_core`` against real process groups, streams and tensors. Today
it holds the ``fsdp-plan`` command (``fsdp_shell.plan_cli``) and the simulated world
(``fsdp_shell.simulated_world``), a reference interpreter that runs a plan for every rank of a
world in one process; the ``nn.Module`` wrapper is being built on top of them.
"""
