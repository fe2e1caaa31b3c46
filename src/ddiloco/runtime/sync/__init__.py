"""The synchronizer process: the gRPC service that runs the protocol core for a run."""
