"""The shell in one process: predictions, CLIs, the in-process oracle, the live-byte counter."""
