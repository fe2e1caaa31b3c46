"""A fragment's encoded payload cut down to one rank's slice, and that cut decoded.

A rank of a sharded (FSDP2) learner holds one slice of each fragment (``core/shared/slices.py``), but
an update is encoded over the whole fragment. The synchronizer cuts it before it sends it, so each
rank receives the bytes of its own slice only, never a whole fragment; the rank decodes the cut. The
codecs are local: fp32 and bf16 are one value per 4 or 2 bytes, and a blockwise codec's block is its
float32 scale plus its packed codes (``core/shared/codecs.py``), so a range needs only the blocks it
touches. A cut is, range after range, the bytes of those values (or of those blocks' scales, then
their codes): about 1/W of the payload plus at most two blocks per range. Decoding it gives the whole
payload decoded and cut, bit for bit (``tests/core/test_slice_cut.py``), so a rank's anchor is its
slice of the synchronizer's canonical value. A codec whose blocks do not end on a byte boundary has
nothing to cut along: its cut is the whole payload (no configured codec is one).

I/O-free; both sides use it: the synchronizer cuts, the learner's rank decodes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ddiloco.core.shared.codecs import Bf16Codec, Codec, Fp32Codec, _BlockCodec
from ddiloco.core.shared.slices import SliceSpec


@dataclass(frozen=True, slots=True)
class _Piece:
    """One range of a slice: the byte spans of the payload it needs, and where its values lie in what
    those spans decode to (``lo``..``hi`` values decoded, of which ``skip``.. ``skip + length`` are its)."""

    spans: tuple[tuple[int, int], ...]
    decoded: int
    skip: int
    length: int

    @property
    def size(self) -> int:
        return sum(stop - start for start, stop in self.spans)


def _pieces(codec: Codec, numel: int, spec: SliceSpec) -> list[_Piece]:
    if spec.end > numel:
        raise ValueError(f"slice reaches index {spec.end} of {numel} values")
    pieces = []
    for start, length in spec.ranges:
        if isinstance(codec, (Fp32Codec, Bf16Codec)):
            width = 4 if isinstance(codec, Fp32Codec) else 2
            pieces.append(_Piece(((start * width, (start + length) * width),), length, 0, length))
        elif isinstance(codec, _BlockCodec) and (codec.block_size * codec.bits) % 8 == 0:
            block = codec.block_size
            first, last = start // block, (start + length - 1) // block + 1  # the blocks the range touches
            codes_at = 4 * -(-numel // block)
            lo, hi = first * block, min(last * block, numel)
            pieces.append(_Piece(((4 * first, 4 * last),
                                  (codes_at + lo * codec.bits // 8, codes_at + -(-hi * codec.bits // 8))),
                                 hi - lo, start - lo, length))
        else:  # nothing to cut along: the whole payload, decoded whole
            pieces.append(_Piece(((0, codec.encoded_size(numel)),), numel, start, length))
    return pieces


def cut_size(codec: Codec, numel: int, spec: SliceSpec) -> int:
    """Bytes of ``spec``'s cut of a payload that encodes ``numel`` values."""
    return sum(p.size for p in _pieces(codec, numel, spec))


def cut_payload(codec: Codec, payload: bytes | memoryview, numel: int, spec: SliceSpec) -> bytes:
    """The bytes of ``payload`` (``numel`` values encoded by ``codec``) that ``spec``'s ranges need."""
    if len(payload) != codec.encoded_size(numel):
        raise ValueError(f"{len(payload)} payload bytes, expected {codec.encoded_size(numel)} for {numel} values")
    view = memoryview(payload)
    return b"".join(view[a:b] for piece in _pieces(codec, numel, spec) for a, b in piece.spans)


def decode_cut(codec: Codec, cut: bytes | memoryview, numel: int, spec: SliceSpec) -> torch.Tensor:
    """The values of ``spec``'s ranges, back to back (float32), from its cut (:func:`cut_payload`)."""
    pieces = _pieces(codec, numel, spec)
    expected = sum(p.size for p in pieces)
    if len(cut) != expected:
        raise ValueError(f"{len(cut)} bytes for the slice of {spec.numel} values, expected {expected}")
    view = memoryview(cut)
    out = torch.empty(spec.numel, dtype=torch.float32)  # filled range by range: no second copy to concatenate
    at = filled = 0
    for piece in pieces:
        values = codec.decode(bytes(view[at:at + piece.size]), piece.decoded)
        out[filled:filled + piece.length] = values[piece.skip:piece.skip + piece.length]
        at += piece.size
        filled += piece.length
    return out
