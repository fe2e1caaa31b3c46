"""A rank's slice of a whole payload, decoded alone, equals the whole payload decoded and cut."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ddiloco.core.shared.choices import CodecName
from ddiloco.core.shared.codecs import get_codec
from ddiloco.core.learner_side.slice_codec import decode_slice
from ddiloco.core.shared.slices import SliceSpec, fragment_slice


@settings(max_examples=60, deadline=None)
@given(shapes=st.lists(st.lists(st.integers(1, 40), min_size=1, max_size=2).map(tuple), min_size=1, max_size=4),
       world=st.integers(1, 4), codec_name=st.sampled_from([c.value for c in CodecName]),
       block=st.sampled_from([8, 16, 128]))
def test_a_slice_decoded_alone_is_the_whole_decoded_and_cut(shapes, world, codec_name, block):
    numel = sum(math.prod(s) for s in shapes)
    codec = get_codec(codec_name, block_size=block)
    payload = codec.encode(torch.randn(numel, generator=torch.Generator().manual_seed(numel)))
    whole = codec.decode(payload, numel)
    for rank in range(world):
        spec = fragment_slice(shapes, rank, world)
        expected = torch.cat([whole[a:a + n] for a, n in spec.ranges]) if spec.ranges else torch.empty(0)
        assert torch.equal(decode_slice(codec, payload, numel, spec), expected)


def test_a_payload_of_the_wrong_size_or_a_slice_past_the_end_is_refused():
    codec = get_codec("int4")
    payload = codec.encode(torch.ones(300))
    with pytest.raises(ValueError, match="expected"):
        decode_slice(codec, payload[:-1], 300, SliceSpec(0, 1, ((0, 300),)))
    with pytest.raises(ValueError, match="index 301"):
        decode_slice(codec, payload, 300, SliceSpec(0, 1, ((1, 300),)))
