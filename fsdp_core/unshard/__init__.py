"""The all-gather side: the schedule of gathers, awaits and reshards at each hook of an iteration
(``schedule``), its verifier (``verifier``) and its rendering (``render``). The names are exported
by ``fsdp_core``."""
