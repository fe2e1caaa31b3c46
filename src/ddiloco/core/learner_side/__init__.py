"""What a learner decides: its state machine, send schedule, link watch and flat buffers."""
