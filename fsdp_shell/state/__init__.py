"""What is saved and loaded: state dicts with the unwrapped module's keys, optimizer state dicts
by original parameter name, and crash-safe verified checkpoints."""
