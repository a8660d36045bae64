"""PyTorch's FSDP2 API (``fully_shard``, ``FSDPModule``) on this library's plans: ``api`` the
functions and methods users call, ``group`` one call's per-parameter unit (DTensor parameters,
gather, free, the plans' owner), ``state`` the hooks of an iteration, ``units`` what a call
decides before any runtime exists (its parameters, layout, settings and plan request; the
prediction uses it too), ``gathers`` the all-gather schedule that runs."""
