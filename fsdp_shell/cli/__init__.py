"""Console scripts that need no process group: ``fsdp-plan`` (``plan``) and ``fsdp-sim``
(``sim``), their argument parser, and the launcher of local gloo worlds (``launch``)."""
