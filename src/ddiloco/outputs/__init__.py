"""What a run leaves behind, whichever driver ran it: summaries, metrics, plots, TensorBoard events."""
