"""Starting a real run on one machine: the synchronizer and learner processes (or real data
parallel), each in its own network namespace on capped links if asked, ended with their parent."""
