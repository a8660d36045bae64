"""The code base itself: import boundaries, documents, the bare install, exhaustiveness by mypy."""
