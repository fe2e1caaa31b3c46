"""What the learner's and the synchronizer's state machines share: messages, actions, codecs,
the protocol's configuration, deadlines, fragments, kernels and the rules both apply."""
