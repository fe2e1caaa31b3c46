"""A fragment's parameters as views into one flat buffer, beside the anchor they are measured from.

Why: the protocol sees a fragment as one flat vector — Δ = anchor − θ when it falls due,
θ ← α·θ + (1−α)·anchor when an update lands. With the parameters in tensors of their own,
each of those first gathers them (``torch.cat``) and the merge scatters the result back:
about five passes over the fragment per update, on the training thread. Laid out once as
views into one contiguous buffer, the flat vector *is* the parameters: binding sets
``param.data`` to a view, so the Parameter objects — and the optimizer's hold on them — stay.
On the CPU, in float32 and with the int4 codecs, Δ → payload and payload → anchor → θ are
then one pass each, without the GIL (``core/learner_side/learner_kernels.py``); elsewhere (an accelerator,
another dtype or codec) they are torch ops on the buffer, without the copies. A fragment whose
parameters differ in dtype or device (fp32 norms beside bf16 weights) cannot share a buffer:
it is gathered and scattered at each use, as before.

The binding holds only while the model keeps its parameters in place. Every use checks that
each parameter is still the view it was given — same storage, shape, dtype, device, strides
— and names the first that is not (``ParameterError``) rather than measure a Δ from memory
training no longer writes. The check is O(tensors), not O(elements).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from ddiloco.core.learner_side.learner_kernels import apply_int4, delta_int4
from ddiloco.core.shared.codecs import Codec, fused_int4, int4_parts
from ddiloco.core.shared.errors import ParameterError
from ddiloco.core.shared.fragments import flatten, unflatten_into

AFTER_START = "after the learner started"
GATHER_VALUES = 1 << 20
"""Values an unbound fragment's Δ gathers per pass (4 MiB of float32), for the fused int4 kernel."""


class FlatFragment:
    """One fragment: its parameters bound to one flat buffer, and its float32 anchor."""

    def __init__(self, index: int, names: Sequence[str], tensors: Sequence[Tensor], uplink: Codec,
                 downlink: Codec, *, bind: bool = True) -> None:
        self.index = index
        self.names = tuple(names)
        self._tensors = tuple(tensors)
        self.buffer = _bind(self.names, self._tensors) if bind else None
        """The parameters back to back (None: they differ in dtype or device, or must keep the memory
        they have — an FSDP2 shard, which FSDP reads from its own buffer — and stay apart)."""
        self._views = tuple((t.data_ptr(), t.shape, t.dtype, t.device) for t in self._tensors)
        self.anchor = self._gather().to(torch.float32, copy=True)
        """The global value last adopted (beside the parameters, on their device)."""
        self._uplink, self._downlink = uplink, downlink
        host_fp32 = (self.buffer is not None and self.buffer.device.type == "cpu"
                     and self.buffer.dtype == torch.float32)
        unbound_fp32 = self.buffer is None and all(t.device.type == "cpu" and t.dtype == torch.float32
                                                   for t in self._tensors)
        self.fused_up = (host_fp32 or unbound_fp32) and fused_int4(uplink)
        """Δ is encoded here, in one pass, into the payload (else returned as a tensor to encode). An
        unbound fragment's parameters (an FSDP2 shard's) are gathered a run of blocks at a time into a
        small scratch first: no float32 Δ of the whole fragment, and the encoding off the interpreter lock."""
        self.fused_down = host_fp32 and fused_int4(downlink)
        """Updates are applied from their payload in one pass (no decoded tensor needed)."""
        if self.fused_up or self.fused_down:
            self._anchor_np = self.anchor.numpy()
            self._local_np = self.buffer.numpy() if self.buffer is not None else None

    @property
    def numel(self) -> int:
        return self.anchor.numel()

    def check(self) -> None:
        """Raise ``ParameterError`` naming the first parameter that is no longer the memory bound."""
        for name, t, (ptr, shape, dtype, device) in zip(self.names, self._tensors, self._views):
            if t.data_ptr() != ptr or t.shape != shape or t.dtype != dtype or t.device != device \
                    or not t.is_contiguous():
                raise changed(name, t, shape, dtype, device, "was replaced by other memory (param.data = ...?)"
                              if t.data_ptr() != ptr else f"is no longer contiguous (strides {t.stride()})")

    def adopt(self, values: Tensor) -> None:
        """Take a global state: parameters and anchor ← values (flat float32)."""
        self.check()
        with torch.no_grad():
            self._scatter(values)
            self.anchor.copy_(values)

    def take_delta(self) -> Tensor | np.ndarray:
        """Δ = anchor − θ: the int4 payload itself when ``fused_up`` (a new buffer of its exact
        size, one pass), else a new float32 tensor for the codec (one pass)."""
        self.check()
        if not self.fused_up and self.buffer is None:  # one parameter at a time: no gathered copy beside Δ
            delta = self.anchor.clone()
            for segment, t in self._segments(delta):
                segment.sub_(t.detach().reshape(-1).to(torch.float32))
            return delta
        if not self.fused_up:
            return self.anchor - self._gather().to(torch.float32)
        block = self._uplink.block_size  # type: ignore[attr-defined]
        blocks = -(-self.numel // block)
        payload = np.empty(self._uplink.encoded_size(self.numel), dtype=np.uint8)
        scales, packed = payload[: 4 * blocks].view("<f4"), payload[4 * blocks:]
        if self._local_np is not None:
            bad = delta_int4(self._anchor_np, self._local_np, block, scales, packed)
        else:
            bad = self._delta_in_passes(block, scales, packed)
        if bad:
            raise ValueError(f"fragment {self.index}: Δ is not finite in {bad} of its {blocks} blocks (NaN or inf "
                             f"in parameters {list(self.names)}): the model diverged")
        return payload

    def apply(self, payload: bytes, values: Tensor | None, alpha: float) -> None:
        """anchor += update; θ ← α·θ + (1−α)·anchor. ``values``: the payload decoded by the
        driver, or None to decode it here (in the fused pass when ``fused_down``)."""
        self.check()
        if values is None and self.fused_down:
            block = self._downlink.block_size  # type: ignore[attr-defined]
            expected = self._downlink.encoded_size(self.numel)
            if len(payload) != expected:
                raise ValueError(f"update for fragment {self.index}: {len(payload)} bytes, expected {expected}")
            scales, packed = int4_parts(payload, self.numel, block)
            apply_int4(scales, packed, block, self._anchor_np, self._local_np, alpha)
            return
        if values is None:
            values = self._downlink.decode(payload, self.numel)
        elif values.shape != self.anchor.shape:
            raise ValueError(f"update for fragment {self.index}: {values.numel()} decoded values, "
                             f"expected {self.numel}")
        with torch.no_grad():
            self.anchor += values.to(self.anchor.device, non_blocking=True)  # pinned memory: no wait for the device
            self._mix(alpha)

    def take(self, values: Tensor, held: int, version: int, *, keepable: bool, alpha: float) -> bool:
        """A (re)join's global value at ``version`` for this fragment, held at ``held`` (−1: never):
        keep θ and the anchor when the anchor is that very value (a synchronizer restarted from its
        round log) and the progress is ``keepable``; move to it as the updates it replaces would
        have when it is newer; adopt it otherwise (a first join, or a synchronizer that went back).
        True if kept."""
        if held == version and keepable and torch.equal(values.to(self.anchor.device), self.anchor):
            return True
        if 0 <= held < version:
            self.move_to(values, alpha)
        else:
            self.adopt(values)
        return False

    def move_to(self, values: Tensor, alpha: float) -> None:
        """A newer global state than the anchor (a rejoin after missed updates): anchor ← values and
        θ ← α·θ + (1−α)·anchor, as the updates it replaces would have done."""
        self.check()
        with torch.no_grad():
            self.anchor.copy_(values)
            self._mix(alpha)

    def _mix(self, alpha: float) -> None:
        if self.buffer is None:  # unbound (an FSDP2 shard): one parameter at a time, no gathered copy
            for segment, t in self._segments(self.anchor):
                if not alpha:
                    t.copy_(segment.view(t.shape))
                elif t.dtype == torch.float32:
                    t.mul_(alpha).add_(segment.view(t.shape), alpha=1.0 - alpha)
                else:
                    t.copy_(t.to(torch.float32).mul_(alpha).add_(segment.view(t.shape), alpha=1.0 - alpha))
            return
        local = self._gather().to(torch.float32)  # a float32 buffer itself: merged in place
        if alpha:
            local.mul_(alpha).add_(self.anchor, alpha=1.0 - alpha)
        else:
            local.copy_(self.anchor)
        if local is not self.buffer:
            self._scatter(local)

    def _delta_in_passes(self, block: int, scales: np.ndarray, packed: np.ndarray) -> int:
        """``delta_int4`` of an unbound fragment, a run of whole blocks at a time: each run's parameters
        gathered into one small scratch (never a copy of the whole fragment beside the anchor)."""
        step = block * max(1, GATHER_VALUES // block)
        scratch = torch.empty(min(step, self.numel), dtype=torch.float32)
        bad = 0
        for start in range(0, self.numel, step):
            run = scratch[: min(step, self.numel - start)]
            self._gather_range(run, start)
            first = start // block
            bad += delta_int4(self._anchor_np[start:start + run.numel()], run.numpy(), block,
                              scales[first:first + -(-run.numel() // block)], packed[start >> 1:])
        return bad

    def _gather_range(self, out: Tensor, start: int) -> None:
        """Values ``start`` .. ``start + len(out)`` of the flat vector, copied from the parameters into ``out``."""
        end, offset = start + out.numel(), 0
        with torch.no_grad():
            for t in self._tensors:
                lo, hi = max(start, offset), min(end, offset + t.numel())
                if lo < hi:
                    out[lo - start:hi - start].copy_(t.reshape(-1)[lo - offset:hi - offset])
                offset += t.numel()

    def _segments(self, flat: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Each parameter beside its part of ``flat`` (a view; the anchor, or a vector laid out like it)."""
        pairs, offset = [], 0
        for t in self._tensors:
            pairs.append((flat[offset:offset + t.numel()], t))
            offset += t.numel()
        return pairs

    def _gather(self) -> Tensor:
        """The parameters as one flat vector: the buffer itself, or a copy when unbound."""
        return self.buffer if self.buffer is not None else flatten(self._tensors)

    def _scatter(self, flat: Tensor) -> None:
        if self.buffer is not None:
            self.buffer.copy_(flat)
        else:
            unflatten_into(flat, self._tensors)


def changed(name: str, now: Tensor, shape: torch.Size, dtype: torch.dtype, device: torch.device,
            otherwise: str) -> ParameterError:
    """The one line that says what became of a bound parameter (``otherwise``: when shape,
    dtype and device are still as bound)."""
    if now.shape != shape:
        why = f"changed shape from {tuple(shape)} to {tuple(now.shape)}"
    elif now.dtype != dtype:
        why = f"changed dtype from {dtype} to {now.dtype} (model.to(dtype), .half()?)"
    elif now.device != device:
        why = f"moved from {device} to {now.device} (model.to(device)? move the model before the learner starts)"
    else:
        why = otherwise
    return ParameterError(f"parameter {name!r} {why} {AFTER_START}: its Δ would be measured from memory training "
                          "no longer writes (change parameters in place, e.g. param.copy_)")


class ModelHold:
    """Does the model still hold the Parameter objects the learner bound? ``model.to()`` across
    devices, ``load_state_dict(assign=True)`` or ``module.weight = nn.Parameter(...)`` put new
    ones in their place, which the flat buffers know nothing of. O(tensors) dictionary lookups."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._owners = [(f"{prefix}.{attr}" if prefix else attr, module._parameters, attr, p)
                        for prefix, module in model.named_modules(remove_duplicate=False)
                        for attr, p in module._parameters.items() if p is not None]

    def check(self) -> None:
        for name, params, attr, bound in self._owners:
            now = params.get(attr)
            if now is not bound:
                if now is None:
                    raise ParameterError(f"parameter {name!r} was removed {AFTER_START}")
                raise changed(name, now, bound.shape, bound.dtype, bound.device,
                              "was replaced by a new Parameter (load_state_dict(assign=True)?)")


def _bind(names: Sequence[str], tensors: Sequence[Tensor]) -> Tensor | None:
    """One new buffer holding ``tensors`` back to back, each tensor becoming a view into it; None
    when they differ in dtype or device."""
    if not tensors:
        raise ParameterError("a fragment without parameters: the model has none to synchronize")
    first = tensors[0]
    for name, t in zip(names, tensors):
        if not t.is_floating_point():
            raise ParameterError(f"parameter {name!r} is {t.dtype}: only floating-point parameters are trained")
        if not t.is_contiguous():
            raise ParameterError(f"parameter {name!r} is not contiguous (shape {tuple(t.shape)}, strides "
                                 f"{t.stride()}): make it so before the learner starts "
                                 "(param.data = param.data.contiguous())")
    if any((t.dtype, t.device) != (first.dtype, first.device) for t in tensors):
        return None
    buffer = torch.empty(sum(t.numel() for t in tensors), dtype=first.dtype, device=first.device)
    offset = 0
    with torch.no_grad():
        for t in tensors:
            view = buffer[offset : offset + t.numel()].view(t.shape)
            view.copy_(t)
            t.data = view
            offset += t.numel()
    return buffer
