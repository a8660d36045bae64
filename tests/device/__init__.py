"""The accelerator runtime: on the checked-streams device on CPU, and on a real GPU when present."""
