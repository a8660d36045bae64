"""What keeps ranks from hanging or training wrong: the agreement before the first collective,
the event sequencer for models whose ranks take different paths, and timeouts turned into errors
that say where a rank was."""
