"""Analytic models of Decoupled DiLoCo at scales no single machine can run.

The goodput model (:mod:`ddiloco.scale.goodput_model`, calibrated by
:mod:`ddiloco.scale.goodput_fit`; its closed form for a few learners, :mod:`ddiloco.scale.small_cluster`) and the wide-area bandwidth model
(:mod:`ddiloco.scale.bandwidth_model`) compute from closed forms and sampled failure
processes; they run no protocol. They live apart from :mod:`ddiloco.sim`, the virtual cluster
that runs the real protocol core, and neither package imports the other: the benchmarks and
tests cross-check the two from outside.
"""
