"""Starting a real run on one machine: the synchronizer and learner processes (or real data
parallel, :mod:`ddiloco.baseline`), each in its own network namespace on capped links if asked,
ended with their parent.

- :mod:`~ddiloco.runtime.launch.launcher`: ``ddiloco run --runtime processes``: start, watch and
  evaluate a run, returning the virtual cluster's summary and metrics rows;
- :mod:`~ddiloco.runtime.launch.local_run`: the pieces a run on one machine shares with real data
  parallel, ``ddiloco chaos`` and ``ddiloco launch``: its files, its synchronizer processes, the
  global evaluator;
- :mod:`~ddiloco.runtime.launch.command_lines`: ``ddiloco sync``'s and ``ddiloco learner``'s command
  lines, built once for every launcher and the tests' harness;
- :mod:`~ddiloco.runtime.launch.processes`: the children of a run: they die with their parent and
  are stopped in order (learners first, the synchronizer last);
- :mod:`~ddiloco.runtime.launch.child`: the entry every child starts through, which asks the kernel
  to kill it when its parent dies;
- :mod:`~ddiloco.runtime.launch.supervise`: ``ddiloco launch``'s supervisor: a synchronizer and M
  copies of the user's script, a crashed copy restarted under its id;
- :mod:`~ddiloco.runtime.launch.placement`: where the children live: all on loopback, or each in
  its own network namespace with a shared token;
- :mod:`~ddiloco.runtime.launch.netns`: network namespaces joined by veth pairs and bridges, links
  capped with ``tc``, and what a killed run left behind removed;
- :mod:`~ddiloco.runtime.launch.topology`: regions and link rates (``--link-rate``,
  ``--topology``), checked before anything is created;
- :mod:`~ddiloco.runtime.launch.run_log`: ``timeline.jsonl`` once a second, and the summary's
  events from what the synchronizer counted.
"""
