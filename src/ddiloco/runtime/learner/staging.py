"""A learner's copies between the host and its accelerator, made so the training stream never waits.

On a GPU, a blocking copy is a stall: ``Δ.cpu()`` enqueues behind every kernel of the step
on the training stream and holds the next ones back while the bytes cross PCIe; a plain
``host_tensor.to("cuda")`` from pageable memory makes the training thread wait until the
stream has drained, so the GPU idles while the CPU queues the next step. Here instead:

- **Δ out.** At the step boundary the core takes Δ on the device (one kernel). A side
  stream waits for that kernel (an event, not a host wait), compresses Δ there with the
  uplink codec (``Codec.encode_tensor``: int4 is 0.53 B/param, so an eighth of fp32's bytes
  cross PCIe), copies the payload straight into the fragment's out slot (``slots.py``; the
  link registers the slots' region as pinned host memory, :meth:`HostStaging.register`) and
  records an event; the ``Send`` carries the payload and ``ready``, which the link's finisher
  thread calls before it announces the slot to the helper process (``link.py``): it waits for
  that event and refuses a payload whose scales say Δ was not finite. The training thread
  never waits; the copy overlaps the next step's compute. Where the slot cannot take it (the
  region could not be registered, or the fragment's previous Δ is still on its way into it)
  the payload goes through a pinned buffer, which the finisher copies into the slot.
- **Updates in.** The link's relay thread copies each update's payload from its slot (pinned:
  no copy on the host) on the side stream to the device, where it is decoded
  (``Codec.decode_tensor``); the relay then waits for that stream, releases the slot and hands
  the values on. The core adds them to the anchor on the training stream between two steps,
  like any kernel, without a copy. On the CPU the helper process decodes into the slot; where
  the core applies an update straight from its payload (the CPU with int4: one fused pass,
  ``core/learner_side/flat.py``) nothing is decoded ahead: that would only add passes.

Memory is safe by construction: pinned buffers come from PyTorch's caching host
allocator, which records an event on the stream of every asynchronous copy and does not
hand a block out again before it has passed; a slot is announced (Δ) or released (an
update) only after the event of its copy has passed, and the region is unregistered only
once the side stream is idle; Δ's device memory is marked as used by the
side stream (``record_stream``) so the training stream cannot reuse it under the codec, and
decoded values as used by the training stream, so the side stream cannot reuse them under
the merge.
On the CPU (and MPS) staging changes nothing: Δ is already a host copy (or its payload), and
updates are at most decoded ahead, off the training thread.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import numpy as np
import torch

from ddiloco.core.shared.actions import LearnerAction, Send
from ddiloco.core.shared.codecs import Codec
from ddiloco.core.shared.messages import FragmentUpdate

log = logging.getLogger("ddiloco.learner")

HOST_REGISTER_PORTABLE = 1
"""``cudaHostRegisterPortable``: pinned for every CUDA context, as ``torch.cuda._pin_memory_utils`` registers."""


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
        self.training = torch.cuda.current_stream(device) if device.type == "cuda" else None
        """The stream the runtime is built on, which trains and applies updates."""
        self.registered: int | None = None
        """The address of the host region registered as pinned memory (the link's slots), if any."""
        self.into: Callable[[int, int], torch.Tensor | None] | None = None
        """Where fragment p's payload of n bytes may be copied straight from the device (its out
        slot, begun), or None: through a pinned buffer. Set by the link once the slots are pinned."""

    @property
    def asynchronous(self) -> bool:
        """Copies run on a side stream and into pinned memory (a CUDA device)."""
        return self.side is not None

    def register(self, address: int, nbytes: int) -> bool:
        """Pin the host region ``[address, address + nbytes)`` (page-aligned) for asynchronous copies
        (``cudaHostRegister``); False, with one line in the log, where it cannot be (then copies
        go through pinned buffers), and on the CPU, where nothing is to be done."""
        if self.side is None or nbytes == 0:
            return False
        error: int | str
        try:
            error = int(torch.cuda.cudart().cudaHostRegister(address, nbytes, HOST_REGISTER_PORTABLE))
        except Exception as err:  # noqa: BLE001  # any failure: the pinned buffers still work
            error = str(err)
        if error != 0:
            log.warning("the link's slots (%d bytes) could not be pinned (cudaHostRegister: %s): copies go through "
                        "pinned buffers", nbytes, error)
            return False
        self.registered = address
        return True

    def unregister(self) -> None:
        """Unpin the region once no copy from or to it is pending on the side stream."""
        if self.registered is None or self.side is None:
            return
        self.into = None
        self.side.synchronize()
        error: int | str
        try:
            error = int(torch.cuda.cudart().cudaHostUnregister(self.registered))
        except Exception as err:  # noqa: BLE001  # the process is closing its link: say it, go on
            error = str(err)
        if error != 0:
            log.warning("the link's slots could not be unpinned (cudaHostUnregister: %s)", error)
        self.registered = None

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
            payload = send.codec.encode_tensor(delta)
            host = self.into(send.fragment, payload.numel()) if self.into is not None else None
            if host is None:
                host = torch.empty(payload.shape, dtype=torch.uint8, pin_memory=True)
            host.copy_(payload, non_blocking=True)
            copied = torch.cuda.Event(blocking=True)  # the finisher thread sleeps while it waits
            copied.record(side)
        delta.record_stream(side)
        encoded = host.numpy()
        return dataclasses.replace(send, delta=None, encoded=encoded,
                                   ready=checked_after(copied.synchronize, send.codec, encoded, delta.numel()))

    def decode(self, update: FragmentUpdate, *, pinned: bool = False) -> torch.Tensor | None:
        """The update's values, decoded now by the receiving thread (on the GPU, ready before
        they are handed on, and the payload no longer read); None when they do not fit this
        learner (the core then decodes, and refuses, on its own) or where the core decodes in
        its merge. ``pinned``: the payload is an array in the registered region, copied from as it is."""
        if (update.codec != self.downlink.name or not 0 <= update.fragment < len(self.numels)
                or self.core_decodes[update.fragment]):
            return None
        numel = self.numels[update.fragment]
        if len(update.payload) != self.downlink.encoded_size(numel):
            return None
        if self.side is None:
            return self.downlink.decode(update.payload, numel)
        if pinned and isinstance(update.payload, np.ndarray):
            host = torch.from_numpy(update.payload)
        else:
            host = torch.empty(len(update.payload), dtype=torch.uint8, pin_memory=True)
            host.numpy()[:] = np.frombuffer(update.payload, dtype=np.uint8)
        with torch.cuda.stream(self.side):
            values = self.downlink.decode_tensor(host.to(self.device, non_blocking=True), numel)
            decoded = torch.cuda.Event(blocking=True)
            decoded.record(self.side)
        decoded.synchronize()  # the receiver thread waits, so the values are whole when the core reads them
        assert self.training is not None
        values.record_stream(self.training)
        return values


def checked_after(wait: Callable[[], object], codec: Codec, payload: np.ndarray, numel: int) -> Callable[[], None]:
    """What the sender calls before it uploads a payload compressed on the device: ``wait`` for
    its copy, then refuse it, as the host's codec would have, if Δ was not finite."""

    def ready() -> None:
        wait()
        if codec.non_finite(payload, numel):
            raise ValueError(f"{codec.name} cannot encode non-finite values")

    return ready
