"""Pure ``fsdp_core``: hand-worked values, properties and the verifiers; no process, no runtime."""
