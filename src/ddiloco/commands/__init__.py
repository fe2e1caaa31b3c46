"""One module per ``ddiloco`` subcommand (each with ``HELP`` and ``add_parser``, listed by
:mod:`ddiloco.cli`), and what several of them share. A command parses, checks and calls the
library; it imports torch only once its arguments are checked.

- :mod:`~ddiloco.commands.run`: ``ddiloco run``: train the reference workload on the virtual
  cluster, or as real processes (``--runtime processes``);
- :mod:`~ddiloco.commands.compare`: ``ddiloco compare``: the four modes on the same workload,
  seed, budget and failure trace;
- :mod:`~ddiloco.commands.simtest`: ``ddiloco simtest``: swarm simulation testing over many seeds;
- :mod:`~ddiloco.commands.fingerprint`: ``ddiloco fingerprint``: the behaviour fingerprint of this tree;
- :mod:`~ddiloco.commands.goodput`: ``ddiloco goodput``: the goodput model's table, planning answer
  and calibration at datacenter scale;
- :mod:`~ddiloco.commands.bandwidth`: ``ddiloco bandwidth``: wide-area bandwidth of data parallel
  against Decoupled DiLoCo;
- :mod:`~ddiloco.commands.sync`: ``ddiloco sync``: serve the synchronizer of a real run;
- :mod:`~ddiloco.commands.learner`: ``ddiloco learner``: one learner of a real run on the reference
  workload; its options, read without torch;
- :mod:`~ddiloco.commands.learner_process`: the process behind it: the reference workload's training
  loop around ``LearnerRuntime`` (an application of the library, so it lives above it), with its
  progress file, batch log and clean stop;
- :mod:`~ddiloco.commands.status`: ``ddiloco status``: what a running synchronizer knows, fast
  (no torch);
- :mod:`~ddiloco.commands.chaos`: ``ddiloco chaos``: a real run with faults injected on a schedule,
  and the properties it kept;
- :mod:`~ddiloco.commands.export`: ``ddiloco export``: a run's global model as a file the model loads;
- :mod:`~ddiloco.commands.eval`: ``ddiloco eval``: the eval loss of an exported reference model;
- :mod:`~ddiloco.commands.launch`: ``ddiloco launch``: a synchronizer and M copies of your own
  training script, supervised;
- :mod:`~ddiloco.commands.options`: the options shared by the commands that train the reference
  workload (run, compare, learner);
- :mod:`~ddiloco.commands.display`: progress bars, result tables and "what happened" panels on the
  terminal, laid out to its width, never truncated;
- :mod:`~ddiloco.commands.live_view`: ``ddiloco run``'s live view of the virtual cluster, read from
  snapshots so a watched run trains the same weights;
- :mod:`~ddiloco.commands.interrupt`: SIGTERM unwinds a command like Ctrl-C, so what it did so far
  is written before it exits.
"""
