"""Descriptors: what the user configures (strategy, mixed precision, offload, comm hooks, step
flags), how gradients are averaged (division), where every element of a flat parameter lives
(layout, sharding, shard views), and the hooks of an iteration (events). Immutable, validated
on construction, hashable. The names are exported by ``fsdp_core``."""
