"""The reference workload every driver trains: a byte-level transformer (dense or mixture of
experts), its corpus and shards, the inner trainer, evaluation, and the files its weights live in.

- :mod:`~ddiloco.workload.workload`: the corpus shards, evaluation batches and initial weights
  built once from a configuration, so every mode and runtime trains on the same;
- :mod:`~ddiloco.workload.model`: the decoder-only transformer over raw bytes (GPT-2 shaped, with
  an optional dropless mixture of experts);
- :mod:`~ddiloco.workload.corpus`: loading the text (the standard library's source by default),
  one disjoint shard per learner plus a held-out tail, batch sampling;
- :mod:`~ddiloco.workload.trainer`: one model, one AdamW, one data stream: the inner steps every
  driver runs, so the compute they compare is the same code;
- :mod:`~ddiloco.workload.evaluate`: the held-out eval loss of a language model;
- :mod:`~ddiloco.workload.device`: where a learner trains (``--device``); a device asked for and
  absent is an error, not a fallback;
- :mod:`~ddiloco.workload.checkpoint`: atomic, self-verifying checkpoints (one safetensors file with
  its metadata and a SHA-256 inside);
- :mod:`~ddiloco.workload.model_file`: a model's weights as a plain safetensors ``state_dict``
  file, written atomically, for the export and the end of a run.
"""
