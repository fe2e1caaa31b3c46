"""How a due fragment's Δ gets into its out slot (``slots.py``) for the link's helper to upload.

On the CPU the training thread writes it there itself: the payload the core's fused pass made
(one memcpy), or Δ as float32 for the helper to compress. On a GPU the device copies the
payload in: straight into the slot when the slots' region is pinned (``cudaHostRegister``,
:meth:`~ddiloco.runtime.learner.staging.HostStaging.register`), or into a pinned buffer that the
link's finisher thread then copies into the slot. A slot the device writes is begun (its number
odd: whatever the helper copies meanwhile is refused as torn) when the copy is queued, and
ended only once the copy has landed, so it is never announced half written; while a fragment's
Δ is on its way into its slot, its next Δ takes a pinned buffer rather than the same slot.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from ddiloco.core.shared.actions import Send
from ddiloco.runtime.learner.slots import Slot, SlotArea
from ddiloco.runtime.learner.staging import HostStaging


class OutSlots:
    """The out slots of one learner, as its training process writes them."""

    def __init__(self, slots: SlotArea, staging: HostStaging) -> None:
        self.slots = slots
        self.staging = staging
        self._copying: set[int] = set()
        """Fragments whose Δ the device is copying straight into their slot."""
        self._lock = threading.Lock()
        self.pinned = staging.register(slots.address(), slots.layout.mapped_bytes)
        if self.pinned:
            staging.into = self._into

    def write(self, send: Send) -> tuple[int, bool]:
        """Δ of a send whose values are on the host into its slot; its number to announce, and
        whether it is raw (float32, for the helper to compress)."""
        p = send.fragment
        if send.encoded is not None:
            return self.slots.write(Slot.OUT, p, send.encoded), False
        assert send.delta is not None
        out = self.slots.begin(Slot.OUT, p)
        torch.from_numpy(out[: 4 * send.delta.numel()].view(np.float32)).copy_(send.delta)
        return self.slots.end(Slot.OUT, p, 4 * send.delta.numel()), True

    def finish(self, send: Send) -> int:
        """A send the device copied (its ``ready`` has returned) into its slot; its number to announce."""
        p, encoded = send.fragment, send.encoded
        assert encoded is not None
        if not np.may_share_memory(encoded, self.slots.payload(Slot.OUT, p)):
            return self.slots.write(Slot.OUT, p, encoded)  # from a pinned buffer
        seq = self.slots.end(Slot.OUT, p, encoded.nbytes)
        with self._lock:
            self._copying.discard(p)
        return seq

    def _into(self, p: int, nbytes: int) -> torch.Tensor | None:
        """Fragment p's slot, begun, for the device to copy Δ's payload into; None while its previous
        Δ is still on its way there."""
        slot = self.slots.payload(Slot.OUT, p)
        with self._lock:
            if p in self._copying or nbytes > slot.nbytes:
                return None
            self._copying.add(p)
        self.slots.begin(Slot.OUT, p)
        return torch.from_numpy(slot[:nbytes])

    def close(self) -> None:
        self.staging.unregister()
