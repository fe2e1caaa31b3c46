import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ddiloco.core.shared.codecs import CODEC_NAMES, CodecName, get_codec
from ddiloco.core.shared.errors import ConfigError

BLOCK = 16  # small blocks so short tests cross many block boundaries


def _gauss(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


def _round_trip(name: str, x: torch.Tensor, block_size: int = BLOCK) -> torch.Tensor:
    codec = get_codec(name, block_size=block_size)
    return codec.decode(codec.encode(x), x.numel())


def _block_scales(x: torch.Tensor, qmax: int, block_size: int) -> torch.Tensor:
    """float64 reference: absmax / qmax of each element's block, one entry per element."""
    pad = -x.numel() % block_size
    blocks = torch.nn.functional.pad(x.double(), (0, pad)).view(-1, block_size)
    scales = blocks.abs().amax(dim=1) / qmax
    return scales.repeat_interleave(block_size)[: x.numel()]


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(CODEC_NAMES),
    n=st.one_of(st.sampled_from([0, 1, BLOCK - 1, BLOCK, BLOCK + 1]), st.integers(0, 300)),
    block_size=st.sampled_from([1, 3, BLOCK, 128]),
)
def test_encoded_length_is_exactly_encoded_size(name: str, n: int, block_size: int) -> None:
    codec = get_codec(name, block_size=block_size)
    x = _gauss(n, seed=n)
    data = codec.encode(x)
    assert isinstance(data, bytes) and len(data) == codec.encoded_size(n)
    y = codec.decode(data, n)
    assert y.dtype == torch.float32 and y.shape == (n,)


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (a learner's codec runs on its device)"))]


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(CODEC_NAMES),
    n=st.one_of(st.sampled_from([0, 1, BLOCK - 1, BLOCK, BLOCK + 1]), st.integers(0, 300)),
    block_size=st.sampled_from([1, 3, BLOCK, 128]),
)
def test_the_tensor_forms_on_a_device_are_the_wire_bytes(device: str, name: str, n: int, block_size: int) -> None:
    codec = get_codec(name, block_size=block_size)
    x = _gauss(n, seed=n)
    payload = codec.encode_tensor(x.to(device))
    assert payload.device.type == device and payload.dtype == torch.uint8
    assert payload.cpu().numpy().tobytes() == codec.encode(x)
    decoded = codec.decode_tensor(payload, n)
    assert decoded.device.type == device and torch.equal(decoded.cpu(), codec.decode(codec.encode(x), n))


def test_a_payload_tells_whether_its_input_was_finite() -> None:
    x = _gauss(40)
    x[17] = float("inf")
    for name in CODEC_NAMES:
        codec = get_codec(name, block_size=BLOCK)
        quantizing = name not in ("fp32", "bf16")
        assert codec.non_finite(codec.encode_tensor(x).numpy(), 40) is quantizing
        assert not codec.non_finite(codec.encode_tensor(_gauss(40)).numpy(), 40)


def test_fp32_is_exact_and_bf16_within_half_an_ulp() -> None:
    x = _gauss(1000) * 10.0 ** torch.linspace(-8, 8, 1000)
    assert torch.equal(_round_trip("fp32", x), x)
    rel = ((_round_trip("bf16", x).double() - x.double()).abs() / x.double().abs()).max()
    assert rel <= 2**-8


@pytest.mark.parametrize(("name", "qmax"), [("int8", 127), ("int4", 7), ("int2", 1)])
def test_absmax_error_is_at_most_half_a_step(name: str, qmax: int) -> None:
    x = _gauss(1001) * torch.linspace(0.01, 100.0, 1001)  # blocks of very different scales
    err = (_round_trip(name, x).double() - x.double()).abs()
    bound = _block_scales(x, qmax, BLOCK) / 2
    assert (err <= bound * (1 + 1e-6) + 1e-30).all()


def test_int1_keeps_signs_and_each_blocks_l1_mass() -> None:
    x = _gauss(1000) + 0.3
    y = _round_trip("int1", x)
    assert torch.equal(torch.sign(y), torch.where(x < 0, -1.0, 1.0))
    def block_l1(t: torch.Tensor) -> torch.Tensor:
        padded = torch.nn.functional.pad(t.double().abs(), (0, -t.numel() % BLOCK))
        return padded.view(-1, BLOCK).sum(1)

    assert torch.allclose(block_l1(y), block_l1(x), rtol=1e-6)


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_zeros_decode_to_exact_zeros(name: str) -> None:
    x = _gauss(3 * BLOCK + 5)
    x[BLOCK : 2 * BLOCK] = 0.0  # one zero block among non-zero ones
    y = _round_trip(name, x)
    assert torch.equal(y[BLOCK : 2 * BLOCK], torch.zeros(BLOCK))
    assert torch.equal(_round_trip(name, torch.zeros(37)), torch.zeros(37))


def test_sizes_per_parameter() -> None:
    n = 1 << 20
    per_param = {name: get_codec(name).encoded_size(n) / n for name in CODEC_NAMES}
    assert per_param["fp32"] == 4 and per_param["bf16"] == 2
    assert per_param["int8"] == pytest.approx(1 + 4 / 128)
    assert per_param["int4"] == pytest.approx(0.5 + 4 / 128)
    assert per_param["int2"] == pytest.approx(0.25 + 4 / 128)
    assert per_param["int1"] == pytest.approx(0.125 + 4 / 128)
    int4 = get_codec("int4", block_size=BLOCK)
    assert int4.encoded_size(0) == 0
    assert int4.encoded_size(1) == 4 + 1  # one scale, one byte with a padding nibble
    assert int4.encoded_size(BLOCK + 1) == 8 + math.ceil((BLOCK + 1) / 2)


@pytest.mark.parametrize("name", CODEC_NAMES)
def test_decode_rejects_wrong_length(name: str) -> None:
    codec = get_codec(name)
    data = codec.encode(_gauss(300))
    for bad in (data[:-1], data + b"\0", b""):
        with pytest.raises(ValueError, match="bytes"):
            codec.decode(bad, 300)
    with pytest.raises(ValueError):
        codec.decode(data, 200)


def test_errors_grow_as_bits_shrink_on_gaussian_data() -> None:
    x = _gauss(1 << 14, seed=3)
    names = ("fp32", "bf16", "int8", "int4", "int2")
    errors = [float((_round_trip(n, x, 128) - x).norm()) for n in names]
    assert errors[0] == 0.0
    assert errors == sorted(errors) and len(set(errors)) == len(errors)


def test_encoding_is_deterministic_and_leaves_input_alone() -> None:
    x = _gauss(999)
    before = x.clone()
    for name in CODEC_NAMES:
        codec = get_codec(name, block_size=BLOCK)
        assert codec.encode(x) == codec.encode(x.clone())
        assert torch.equal(x, before)


def test_quantizing_codecs_reject_non_finite_input() -> None:
    x = _gauss(40)
    x[17] = float("nan")
    for name in ("int8", "int4", "int2", "int1"):
        with pytest.raises(ValueError, match="non-finite"):
            get_codec(name).encode(x)


def test_encode_rejects_other_shapes_and_dtypes() -> None:
    with pytest.raises(ValueError, match="1-D float32"):
        get_codec("int4").encode(torch.zeros(2, 3))
    with pytest.raises(ValueError, match="1-D float32"):
        get_codec("fp32").encode(torch.zeros(4, dtype=torch.float64))


@pytest.mark.parametrize("name", list(CodecName))
def test_every_codec_name_builds_the_codec_that_carries_it_as_a_plain_string(name: CodecName) -> None:
    codec = get_codec(name)
    assert codec.name == name and type(codec.name) is str  # what the wire and messages carry: no enum repr


def test_get_codec_rejects_unknown_names_and_bad_blocks() -> None:
    with pytest.raises(ConfigError, match="'int3'.*fp32, bf16, int8, int4, int2, int1"):
        get_codec("int3")
    with pytest.raises(ConfigError, match="block_size must be >= 1, got 0"):
        get_codec("int4", block_size=0)


def test_int4_wire_layout_is_scales_then_low_nibble_first() -> None:
    codec = get_codec("int4", block_size=4)
    data = codec.encode(torch.tensor([1.0, -1.0, 0.6, 0.0, 2.0]))
    scales = torch.tensor([1.0, 2.0]) / 7
    # codes are q + 7: block 0 -> [14, 0, 11 (4.2 rounds to 4), 7], block 1 -> [14]
    assert data == scales.numpy().astype("<f4").tobytes() + bytes([0x0E, 0x7B, 0x0E])


@pytest.mark.parametrize("name,block", [("int8", 128), ("int4", 128), ("int2", 8), ("int1", 128), ("int4", 3)])
def test_a_blockwise_codec_in_passes_gives_the_bytes_and_values_of_one_pass(monkeypatch, name, block):
    """A large vector is encoded and decoded a few blocks at a time (the temporaries of one pass, not of the
    whole vector): the blocks are independent, so the payload and the decoded values are the same."""
    import ddiloco.core.shared.codecs as codecs

    codec = get_codec(name, block_size=block)
    x = torch.randn(10 * 128 + 77, generator=torch.Generator().manual_seed(7))
    one = codec.encode(x), codec.decode(codec.encode(x), x.numel())
    monkeypatch.setattr(codecs, "PASS_VALUES", 256)  # passes of 256 values (or of one block, if larger)
    passes = codec.encode(x)
    assert passes == one[0] and torch.equal(codec.decode(passes, x.numel()), one[1])
