"""Real multi-process gloo worlds, each test beside its rank-side cases (``*_cases.py``)."""
