"""A learner's copies between the host and its accelerator, made so the training stream never waits.

On a GPU, a blocking copy is a stall: ``Δ.cpu()`` enqueues behind every kernel of the step
on the training stream and holds the next ones back while the bytes cross PCIe; a plain
``host_tensor.to("cuda")`` from pageable memory makes the training thread wait until the
stream has drained, so the GPU idles while the CPU queues the next step. Here instead:

- **Δ out.** At the step boundary the core takes Δ on the device (one kernel). A side
  stream waits for that kernel (an event, not a host wait), copies Δ into pinned host
  memory and records an event; the ``Send`` carries ``ready`` = that event's
  ``synchronize``, which the sender thread calls before compressing. The training thread
  never waits; the copy overlaps the next step's compute (a copy engine, not the SMs).
- **Updates in.** The receiver thread decodes each update's payload as it arrives, into
  pinned memory; the core adds it to the anchor with a ``non_blocking`` copy, queued on the
  training stream between two steps like any kernel. Where the core applies an update
  straight from its payload (the CPU with int4: one fused pass, ``core/flat.py``) nothing is
  decoded ahead: that would only add passes.

Memory is safe by construction: pinned buffers come from PyTorch's caching host
allocator, which records an event on the stream of every asynchronous copy and does not
hand a block out again before it has passed; Δ's device memory is marked as used by the
side stream (``record_stream``) so the training stream cannot reuse it under the copy.
On the CPU (and MPS) staging changes nothing: Δ is already a host copy (or its payload), and
updates are at most decoded ahead, off the training thread.
"""

from __future__ import annotations

import dataclasses

import torch

from ddiloco.core.actions import LearnerAction, Send
from ddiloco.core.codecs import Codec
from ddiloco.core.messages import FragmentUpdate


class HostStaging:
    """Stages one learner's outer gradients out of, and updates into, ``device``."""

    def __init__(self, device: torch.device, downlink: Codec, numels: list[int], core_decodes: list[bool]) -> None:
        self.device = device
        self.downlink = downlink
        self.numels = numels
        """Elements of each fragment."""
        self.core_decodes = core_decodes
        """Per fragment: the core applies updates from their payload (``Learner.decodes_updates``)."""
        self.side = torch.cuda.Stream(device) if device.type == "cuda" else None

    @property
    def asynchronous(self) -> bool:
        """Copies run on a side stream and into pinned memory (a CUDA device)."""
        return self.side is not None

    def stage(self, actions: list[LearnerAction]) -> list[LearnerAction]:
        """The actions, with every Send's Δ on its way to pinned host memory."""
        if self.side is None:
            return actions
        return [self._stage(a) if isinstance(a, Send) else a for a in actions]

    def _stage(self, send: Send) -> Send:
        delta, side = send.delta, self.side
        assert side is not None
        if delta is None or delta.device.type != "cuda":
            return send
        side.wait_stream(torch.cuda.current_stream(delta.device))  # after the kernel that took Δ
        with torch.cuda.stream(side):
            host = torch.empty(delta.shape, dtype=delta.dtype, pin_memory=True)
            host.copy_(delta, non_blocking=True)
            copied = torch.cuda.Event(blocking=True)  # the sender thread sleeps while it waits
            copied.record(side)
        delta.record_stream(side)
        return dataclasses.replace(send, delta=host, ready=copied.synchronize)

    def decode(self, update: FragmentUpdate) -> torch.Tensor | None:
        """The update's values, decoded now (on the receiving thread) into memory the device
        copies from without waiting; None when they do not fit this learner (the core then
        decodes, and refuses, on its own) or where the core decodes in its merge."""
        if (update.codec != self.downlink.name or not 0 <= update.fragment < len(self.numels)
                or self.core_decodes[update.fragment]):
            return None
        try:
            values = self.downlink.decode(update.payload, self.numels[update.fragment])
        except ValueError:
            return None
        return values.pin_memory() if self.side is not None else values
