"""The protocol's choices by the names the configuration and the wire spell — codec,
fragmentation, merge rule — apart from the code that carries them out (torch), so that a
configuration is checked, and a bad one refused in one line, without importing torch."""

from __future__ import annotations

import enum


class CodecName(enum.StrEnum):
    """The codecs by the names the configuration and the wire use (``Codec.name`` is the plain string)."""

    FP32 = "fp32"
    BF16 = "bf16"
    INT8 = "int8"
    INT4 = "int4"
    INT2 = "int2"
    INT1 = "int1"


CODEC_NAMES = tuple(name.value for name in CodecName)


class Fragmentation(enum.StrEnum):
    """How parameters are split into fragments (``protocol.fragmentation``)."""

    BALANCED = "balanced"
    LAYERWISE = "layerwise"
    STRIDED = "strided"


class MergeRuleName(enum.StrEnum):
    RDA = "rda"
    """Radial-directional average: the weighted mean norm along the weighted mean direction."""
    MEAN = "mean"
    """The weighted mean (DiLoCo's; always used for the embedding fragment)."""
    RDA_MEDIAN = "rda-median"
    """RDA whose magnitude is the weighted median of the norms: one learner sending an outer
    gradient far larger than the others' (a bug, or a member pushing the model) cannot
    stretch the merged step."""
