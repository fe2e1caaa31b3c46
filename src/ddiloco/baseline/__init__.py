"""Data parallel on real processes, the baseline every real run is compared with (simulated, it
is :mod:`ddiloco.sim.dp_baselines`).

- :mod:`~ddiloco.baseline.data_parallel`: ``ddiloco run --runtime processes --mode dp``: starts M
  ranks where the learners would run, on the same links, and builds the summary from rank 0;
- :mod:`~ddiloco.baseline.dp_worker`: one rank: the same model, weights and shards as a learner,
  gradients all-reduced every step (gloo, bf16), stopping together.
"""
