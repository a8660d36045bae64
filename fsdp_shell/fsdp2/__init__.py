"""PyTorch's FSDP2 API (``fully_shard``, ``FSDPModule``) on this library's plans: ``api`` the
functions and methods users call, ``group`` one call's per-parameter unit (DTensor parameters,
gather, free, the plans' owner), ``state`` the hooks of an iteration."""
