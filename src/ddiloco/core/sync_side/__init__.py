"""What the synchronizer decides: its state machine, registry, rounds, merges, claims and budget."""
