"""What ``ddiloco launch`` tells each copy of the user's script, through its environment.

:meth:`~ddiloco.runtime.learner.runtime.LearnerRuntime.from_env` reads these, so a script
needs no command-line options of its own to join the run (as ``torchrun`` passes ``RANK``
and ``MASTER_ADDR``). No torch here: the launcher imports it.
"""

from __future__ import annotations

CONNECT = "DDILOCO_CONNECT"
"""The synchronizer's address, HOST:PORT (comma-separated for a sharded one)."""
LEARNER_ID = "DDILOCO_LEARNER_ID"
"""This learner's id: stable across its restarts, so a restarted copy rejoins as itself."""
TOKEN = "DDILOCO_TOKEN"
"""The run's shared token (the variable ``ddiloco sync`` and ``ddiloco learner`` read too)."""
DATA_SHARD = "DDILOCO_DATA_SHARD"
"""Which of the run's data shards this learner trains on, 0..M-1 (its loader's part of the data)."""
DATA_SHARDS = "DDILOCO_DATA_SHARDS"
"""M: how many data shards (learners) the run has."""
