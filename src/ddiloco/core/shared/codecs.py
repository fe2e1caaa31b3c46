"""Wire codecs for outer gradients: 1-D float32 vectors to exact-size ``bytes`` and back.

Every codec's output length is a pure function of the vector length (``encoded_size``), so
the bandwidth model can count bytes without encoding anything, and a receiver can reject a
truncated payload before decoding it. All byte layouts are little-endian.

Blockwise codecs (int8, int4, int2, int1) lay out a payload as
``[one float32 scale per block][bit-packed codes, LSB first]``; the codes of the whole
vector are packed back to back, so only the final byte can carry padding bits. They reject
non-finite input: no finite scale could represent it.

- int8/int4/int2: symmetric absmax quantization, scale = absmax / qmax with
  qmax = 2**(bits-1) - 1 (127, 7, 1); values round to nearest (ties to even) in
  [-qmax, qmax], so each element is off by at most scale / 2, and are stored offset by qmax
  as unsigned codes. int2 therefore has the three levels {-1, 0, +1} * absmax, stored as the
  2-bit codes 0, 1, 2 (code 3 is never produced): it wastes a fraction of a bit but keeps
  one rule for every width, and an exact zero.
- int1: one sign bit per element (set for x < 0), scale = mean |x| of the block, so a
  decoded block has the same L1 mass as the original (signSGD-style with a per-block scale).

A zero block has scale 0 and decodes to exact zeros.

Every codec is a pair of tensor functions (``encode_tensor``, ``decode_tensor``) that run
where their input lives: on a GPU a learner quantizes Δ before it leaves the device and
dequantizes an update after its bytes arrive, so 0.53 B/param cross PCIe instead of 4 and the
host only moves bytes (``runtime/learner/staging.py``). ``encode`` and ``decode`` are the
same functions on host bytes. The tensor forms view float32 scales as bytes in the machine's
order, which is the wire's on every platform PyTorch ships for (checked at import).
"""

from __future__ import annotations

import math
import sys
from abc import ABC, abstractmethod

import numpy as np
import torch
from torch import Tensor

from ddiloco.core.shared.choices import CODEC_NAMES, CodecName
from ddiloco.core.shared.errors import ConfigError

if sys.byteorder != "little":  # pragma: no cover - no such platform ships PyTorch wheels
    raise ImportError("ddiloco's wire codecs view float32 as little-endian bytes: this host is big-endian")


class Codec(ABC):
    """Turns a 1-D float32 vector into ``encoded_size(numel)`` bytes and back."""

    name: str

    @abstractmethod
    def encoded_size(self, numel: int) -> int:
        """Exact number of bytes ``encode`` produces for a vector of ``numel`` elements."""

    @abstractmethod
    def _encode_tensor(self, x: Tensor) -> Tensor:
        """The payload of the contiguous 1-D float32 ``x``, as uint8 on ``x``'s device."""

    @abstractmethod
    def _decode_tensor(self, data: Tensor, numel: int) -> Tensor:
        """1-D float32 on ``data``'s device from a payload of the right length."""

    def non_finite(self, payload: np.ndarray, numel: int) -> bool:
        """Does a payload of this codec say its input was not finite? (Only the quantizing
        codecs can tell, from their scales; the float codecs carry NaN and inf through.)"""
        return False

    def encode(self, x: Tensor) -> bytes:
        """Serialize the 1-D float32 vector ``x`` (any length, including 0)."""
        payload = self.encode_tensor(x).cpu().numpy()
        if self.non_finite(payload, x.numel()):
            raise ValueError(f"{self.name} cannot encode non-finite values")
        return payload.tobytes()

    def encode_tensor(self, x: Tensor) -> Tensor:
        """``encode``'s bytes as a uint8 tensor on ``x``'s device (fp32's shares ``x``'s memory).
        It does not check that ``x`` is finite (on a GPU that would make the caller wait for the
        device): check the payload with ``non_finite`` once it is on the host."""
        if x.dim() != 1 or x.dtype != torch.float32:
            raise ValueError(f"{self.name} encodes 1-D float32, got {x.dtype} {tuple(x.shape)}")
        return self._encode_tensor(x.detach().contiguous())

    def decode(self, data: bytes | memoryview, numel: int) -> Tensor:
        """A new 1-D float32 tensor of ``numel`` elements from ``encode``'s output."""
        return self.decode_tensor(torch.from_numpy(np.frombuffer(data, dtype=np.uint8).copy()), numel)

    def decode_tensor(self, data: Tensor, numel: int) -> Tensor:
        """``decode`` of a uint8 payload tensor, on its device (the result may share its memory)."""
        self._check_length(data.numel(), numel)
        if numel == 0:  # an empty byte tensor cannot be viewed as floats
            return torch.empty(0, dtype=torch.float32, device=data.device)
        return self._decode_tensor(data.reshape(-1), numel)

    def _check_length(self, length: int, numel: int) -> None:
        expected = self.encoded_size(numel)
        if length != expected:
            raise ValueError(f"{self.name} payload for {numel} elements must be {expected} bytes, got {length}")

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"


def _check_numel(numel: int) -> None:
    if numel < 0:
        raise ValueError(f"numel must be >= 0, got {numel}")


class Fp32Codec(Codec):
    """Raw float32: the lossless reference."""

    name = CodecName.FP32.value

    def encoded_size(self, numel: int) -> int:
        _check_numel(numel)
        return 4 * numel

    def _encode_tensor(self, x: Tensor) -> Tensor:
        return x.view(torch.uint8)

    def _decode_tensor(self, data: Tensor, numel: int) -> Tensor:
        return data.view(torch.float32)


class Bf16Codec(Codec):
    """bfloat16 (round to nearest even): half the bytes, relative error <= 2**-8."""

    name = CodecName.BF16.value

    def encoded_size(self, numel: int) -> int:
        _check_numel(numel)
        return 2 * numel

    def _encode_tensor(self, x: Tensor) -> Tensor:
        return x.to(torch.bfloat16).view(torch.uint8)

    def _decode_tensor(self, data: Tensor, numel: int) -> Tensor:
        return data.view(torch.bfloat16).to(torch.float32)


PASS_VALUES = 1 << 20
"""Values a blockwise codec encodes or decodes per pass (``_BlockCodec._pass``)."""


class _BlockCodec(Codec):
    """Shared layout of the blockwise codecs: float32 scales, then packed ``bits``-bit codes."""

    bits: int

    def __init__(self, *, block_size: int) -> None:
        if block_size < 1:
            raise ConfigError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size

    def encoded_size(self, numel: int) -> int:
        _check_numel(numel)
        return 4 * math.ceil(numel / self.block_size) + math.ceil(numel * self.bits / 8)

    @abstractmethod
    def _codes_and_scales(self, blocks: Tensor, numel: int) -> tuple[Tensor, Tensor]:
        """(uint8 codes of shape blocks.shape, float32 scale per block)."""

    @abstractmethod
    def _values(self, codes: Tensor, scales: Tensor) -> Tensor:
        """Dequantize (blocks, block_size) uint8 codes to float32."""

    def non_finite(self, payload: np.ndarray, numel: int) -> bool:
        scales = payload[: 4 * math.ceil(numel / self.block_size)].view(np.float32)
        return not bool(np.isfinite(scales).all())

    def _pass(self) -> int | None:
        """Values per pass: a whole number of blocks whose codes fill whole bytes (None: one pass). The
        blocks are independent, so passes give the bytes one pass would, with a few float32 copies of
        one pass's values at a time instead of the whole vector's (a fragment of a large model)."""
        if (self.block_size * self.bits) % 8:
            return None
        return max(1, PASS_VALUES // self.block_size) * self.block_size

    def _encode_tensor(self, x: Tensor) -> Tensor:
        numel, step = x.numel(), self._pass() or x.numel()
        scales, packed = [], []
        for start in range(0, numel, max(step, 1)):
            part = x[start:start + step]
            codes, part_scales = self._codes_and_scales(_pad_to_blocks(part, self.block_size), part.numel())
            scales.append(part_scales)
            packed.append(_pack(codes.reshape(-1)[:part.numel()], self.bits))
        if not scales:  # an empty vector: no blocks, no codes
            return torch.empty(0, dtype=torch.uint8, device=x.device)
        return torch.cat((torch.cat(scales).view(torch.uint8), *packed))

    def _decode_tensor(self, data: Tensor, numel: int) -> Tensor:
        num_blocks = math.ceil(numel / self.block_size)
        step = self._pass() or numel
        out = torch.empty(numel, dtype=torch.float32, device=data.device) if numel > step else None
        for start in range(0, numel, step):
            stop = min(start + step, numel)
            first, last = start // self.block_size, math.ceil(stop / self.block_size)
            scales = data[4 * first: 4 * last].view(torch.float32)
            packed = data[4 * num_blocks + start * self.bits // 8: 4 * num_blocks + math.ceil(stop * self.bits / 8)]
            codes = _unpack(packed, self.bits, stop - start)
            codes = torch.nn.functional.pad(codes, (0, (last - first) * self.block_size - (stop - start)))
            values = self._values(codes.view(last - first, self.block_size), scales).reshape(-1)[:stop - start]
            if out is None:  # one pass: its values are the vector, no copy
                return values
            out[start:stop] = values
        assert out is not None
        return out


def fused_int4(codec: Codec) -> bool:
    """Does ``codec`` use the int4 layout the synchronizer's compiled kernels work on
    (``core/shared/kernels.py``): one float32 scale per block, two codes per byte, even blocks?"""
    return isinstance(codec, AbsmaxCodec) and codec.bits == 4 and codec.block_size % 2 == 0


def int4_parts(payload: bytes, numel: int, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """An int4 payload's scales and packed codes, as numpy views of it (no copy)."""
    blocks = -(-numel // block_size)
    return (np.frombuffer(payload, dtype="<f4", count=blocks),
            np.frombuffer(payload, dtype=np.uint8, offset=4 * blocks))


class AbsmaxCodec(_BlockCodec):
    """Blockwise symmetric absmax quantization to ``bits`` bits (int8, int4, int2)."""

    def __init__(self, *, bits: int, block_size: int) -> None:
        if bits not in (2, 4, 8):
            raise ConfigError(f"absmax quantization supports 2, 4 or 8 bits, got {bits}")
        super().__init__(block_size=block_size)
        self.bits = bits
        self.name = f"int{bits}"
        self.qmax = 2 ** (bits - 1) - 1

    def _codes_and_scales(self, blocks: Tensor, numel: int) -> tuple[Tensor, Tensor]:
        amax = blocks.abs().amax(dim=1)
        # Divided by a tensor, not a Python number: on CUDA, dividing by a host scalar multiplies
        # by its reciprocal, one bit off the host's division, and a GPU learner's scales would
        # not be the bytes a CPU learner sends for the same Δ.
        scales = amax / torch.full_like(amax, self.qmax)
        # A zero block keeps scale 0; dividing its zeros by 1 instead yields exact zero codes.
        divisor = torch.where(scales > 0, scales, torch.ones_like(scales)).unsqueeze(1)
        q = (blocks / divisor).round_().clamp_(-self.qmax, self.qmax).add_(self.qmax)
        return q.to(torch.uint8), scales

    def _values(self, codes: Tensor, scales: Tensor) -> Tensor:
        return (codes.to(torch.float32) - self.qmax) * scales.unsqueeze(1)


class SignCodec(_BlockCodec):
    """int1: sign bits with a per-block scale of mean |x|, preserving each block's L1 mass."""

    name = CodecName.INT1.value
    bits = 1

    def _codes_and_scales(self, blocks: Tensor, numel: int) -> tuple[Tensor, Tensor]:
        counts = torch.full((blocks.shape[0],), float(self.block_size), device=blocks.device, dtype=torch.float64)
        if numel % self.block_size:
            counts[-1] = numel % self.block_size  # the short last block's padding is no data
        # Summed in float64: the order a device sums a block in then no longer shows in the
        # float32 scale, so a GPU learner sends the bytes a CPU learner would.
        scales = (blocks.abs().sum(dim=1, dtype=torch.float64) / counts).to(torch.float32)
        return (blocks < 0).to(torch.uint8), scales

    def _values(self, codes: Tensor, scales: Tensor) -> Tensor:
        return (1.0 - 2.0 * codes.to(torch.float32)) * scales.unsqueeze(1)


def _pad_to_blocks(x: Tensor, block_size: int) -> Tensor:
    pad = -x.numel() % block_size
    padded = torch.nn.functional.pad(x, (0, pad)) if pad else x  # pad copies: only if needed
    return padded.view(-1, block_size)


def _pack(codes: Tensor, bits: int) -> Tensor:
    """Pack uint8 codes < 2**bits into bytes, first code in the lowest bits."""
    if bits == 8:
        return codes
    per_byte = 8 // bits
    padded = torch.nn.functional.pad(codes, (0, -codes.numel() % per_byte))
    lanes = padded.view(-1, per_byte)
    packed = lanes[:, 0].clone()
    for lane in range(1, per_byte):  # at most 8 lanes: a loop over bit positions, not elements
        packed |= lanes[:, lane] << (lane * bits)
    return packed


def _unpack(packed: Tensor, bits: int, numel: int) -> Tensor:
    if bits == 8:
        return packed[:numel]
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    lanes = (packed.unsqueeze(1) >> shifts) & (2**bits - 1)
    return lanes.reshape(-1)[:numel]


DEFAULT_BLOCK_SIZE = 128


def get_codec(name: str, *, block_size: int = DEFAULT_BLOCK_SIZE) -> Codec:
    """The codec called ``name`` (a :class:`CodecName` or its value); ``block_size`` is for the int codecs."""
    try:
        codec = CodecName(name)
    except ValueError:
        raise ConfigError(f"unknown codec {name!r}; valid: {', '.join(CODEC_NAMES)}") from None
    match codec:
        case CodecName.FP32:
            return Fp32Codec()
        case CodecName.BF16:
            return Bf16Codec()
        case CodecName.INT8 | CodecName.INT4 | CodecName.INT2:
            return AbsmaxCodec(bits=int(codec.removeprefix("int")), block_size=block_size)
        case CodecName.INT1:
            return SignCodec(block_size=block_size)
