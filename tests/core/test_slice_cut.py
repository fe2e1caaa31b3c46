"""A rank's cut of a whole payload holds only what its slice needs, and decodes to the whole payload
decoded and cut, bit for bit (``core/shared/slice_cut.py``)."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ddiloco.core.shared.choices import CodecName
from ddiloco.core.shared.codecs import get_codec
from ddiloco.core.shared.slice_cut import cut_payload, cut_size, decode_cut
from ddiloco.core.shared.slices import SliceSpec, fragment_slice


@settings(max_examples=60, deadline=None)
@given(shapes=st.lists(st.lists(st.integers(1, 40), min_size=1, max_size=2).map(tuple), min_size=1, max_size=4),
       world=st.integers(1, 4), codec_name=st.sampled_from([c.value for c in CodecName]),
       block=st.sampled_from([8, 16, 128]))
def test_a_cut_decoded_alone_is_the_whole_decoded_and_cut(shapes, world, codec_name, block):
    numel = sum(math.prod(s) for s in shapes)
    codec = get_codec(codec_name, block_size=block)
    payload = codec.encode(torch.randn(numel, generator=torch.Generator().manual_seed(numel)))
    whole = codec.decode(payload, numel)
    for rank in range(world):
        spec = fragment_slice(shapes, rank, world)
        expected = torch.cat([whole[a:a + n] for a, n in spec.ranges]) if spec.ranges else torch.empty(0)
        cut = cut_payload(codec, payload, numel, spec)
        assert len(cut) == cut_size(codec, numel, spec)
        assert torch.equal(decode_cut(codec, cut, numel, spec), expected)


@pytest.mark.parametrize("codec_name", [c.value for c in CodecName])
def test_each_rank_s_cut_is_its_share_of_the_payload_plus_at_most_two_blocks_per_range(codec_name):
    shapes = [(512, 64), (512,), (64, 512)]  # a 2-rank learner's slices: three ranges each
    numel = sum(math.prod(s) for s in shapes)
    codec = get_codec(codec_name, block_size=128)
    whole = codec.encoded_size(numel)
    block_bytes = codec.encoded_size(128)
    for rank in range(2):
        spec = fragment_slice(shapes, rank, 2)
        share = whole * spec.numel / numel
        assert share <= cut_size(codec, numel, spec) <= share + 2 * len(spec.ranges) * block_bytes
        assert cut_size(codec, numel, spec) < 0.6 * whole  # never the whole fragment


def test_a_cut_of_the_wrong_size_or_a_slice_past_the_end_is_refused():
    codec = get_codec("int4")
    payload = codec.encode(torch.ones(300))
    spec = SliceSpec(0, 2, ((0, 150),))
    with pytest.raises(ValueError, match="expected"):
        cut_payload(codec, payload[:-1], 300, spec)
    with pytest.raises(ValueError, match="expected"):
        decode_cut(codec, cut_payload(codec, payload, 300, spec)[:-1], 300, spec)
    with pytest.raises(ValueError, match="index 301"):
        cut_payload(codec, payload, 300, SliceSpec(0, 1, ((1, 300),)))
