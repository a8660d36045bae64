"""The post-backward plan of one flat parameter: its language (``ops``), the request it is made
for and the plan value (``request``), what carries from one backward into the next (``carry``),
the planner and its cache (``planner``), the verifier (``verifier``), its communication volume
(``comm``) and its rendering (``render``). The names are exported by ``fsdp_core``."""
