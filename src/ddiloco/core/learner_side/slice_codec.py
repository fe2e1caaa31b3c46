"""A rank's slice of a whole fragment's payload, decoded without decoding the rest.

A rank of a sharded learner holds one slice of each fragment (``core/shared/slices.py``), but the
updates and the global state are encoded over the whole fragment. Decoding them whole and then
cutting would make every rank hold a full fragment in float32 at each update. The codecs are
local: fp32 and bf16 are one value per 4 or 2 bytes, and a blockwise codec's block is its scale
plus its packed codes (``core/shared/codecs.py``), so a range is decoded from the blocks it touches only.
The result equals the whole payload decoded and cut, bit for bit (``tests/core/test_slice_codec.py``).
"""

from __future__ import annotations

import torch

from ddiloco.core.shared.codecs import Bf16Codec, Codec, Fp32Codec, _BlockCodec
from ddiloco.core.shared.slices import SliceSpec


def decode_slice(codec: Codec, payload: bytes | memoryview, numel: int, spec: SliceSpec) -> torch.Tensor:
    """The values of ``spec``'s ranges, back to back (float32), of a payload that encodes ``numel`` values."""
    if len(payload) != codec.encoded_size(numel):
        raise ValueError(f"{len(payload)} payload bytes, expected {codec.encoded_size(numel)} for {numel} values")
    if spec.end > numel:
        raise ValueError(f"slice reaches index {spec.end} of {numel} values")
    view = memoryview(payload)
    parts = [_decode_range(codec, view, numel, start, length) for start, length in spec.ranges]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.float32)


def _decode_range(codec: Codec, view: memoryview, numel: int, start: int, length: int) -> torch.Tensor:
    if isinstance(codec, (Fp32Codec, Bf16Codec)):
        width = 4 if isinstance(codec, Fp32Codec) else 2
        return codec.decode(view[start * width:(start + length) * width], length)
    if not isinstance(codec, _BlockCodec) or (codec.block_size * codec.bits) % 8:
        return codec.decode(view, numel)[start:start + length]  # no layout to cut along: decode whole
    block = codec.block_size
    first, last = start // block, (start + length - 1) // block + 1  # the blocks the range touches
    blocks = -(-numel // block)
    lo, hi = first * block, min(last * block, numel)
    scales = view[4 * first:4 * last]
    codes = view[4 * blocks + lo * codec.bits // 8:4 * blocks + -(-hi * codec.bits // 8)]
    values = codec.decode(bytes(scales) + bytes(codes), hi - lo)
    return values[start - lo:start - lo + length]
