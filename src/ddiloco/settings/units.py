"""Counts and sizes in the units a person reads: ``33,952 parameters``, ``1.2M``, ``7B``;
``512 kB``, ``0.49 GB``. A log line once said ``memory for 3.4e-05B parameters``."""

from __future__ import annotations

_COUNT_UNITS = ((1e9, "B"), (1e6, "M"))
_BYTE_UNITS = ((1e9, "GB"), (1e6, "MB"), (1e3, "kB"))


def human_count(n: float) -> str:
    """``33,952``, ``1.2M``, ``7B`` (billions: the B of a model's size)."""
    for scale, unit in _COUNT_UNITS:
        if abs(n) >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:,.0f}"


def human_bytes(n: float) -> str:
    """``512 B``, ``34 kB``, ``490 MB``, ``1.5 GB``: three significant digits, SI units."""
    for scale, unit in _BYTE_UNITS:
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"
