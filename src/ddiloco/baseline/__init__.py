"""Data parallel, the baseline every result is compared with: simulated, and on real processes."""
