"""What a run leaves behind, whichever driver ran it: summaries, metrics, plots, TensorBoard events
(what both drivers measure is :mod:`ddiloco.measures`, below this package).

- :mod:`~ddiloco.outputs.reporting`: the summary, metrics rows, config and plot, written through
  one writer so a simulated run and a real one produce the same files with the same keys;
- :mod:`~ddiloco.outputs.run_plot`: ``plot.png`` and ``compare.png``: eval loss and goodput over
  time with a lane per learner of what happened, redrawable from a run's files;
- :mod:`~ddiloco.outputs.tb_log`: TensorBoard event files of a run's metrics rows and of a
  learner process's progress, to overlay runs without plotting code of ours.
"""
