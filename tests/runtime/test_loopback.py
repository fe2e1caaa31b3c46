"""Which synchronizer addresses are this host's: a learner behind on loopback blames its CPU, never
its link (issue 57; the wording is the core's, ``core/learner_side/link_watch.py``)."""

from __future__ import annotations

import pytest

from ddiloco.runtime.auth import is_loopback


@pytest.mark.parametrize("address, local", [
    ("127.0.0.1:7000", True), ("127.1.2.3:7000", True), ("localhost:7000", True), ("[::1]:7000", True),
    ("10.0.0.5:7000", False), ("sync-host:7000", False), ("[2001:db8::1]:7000", False),
])
def test_loopback_addresses(address: str, local: bool) -> None:
    assert is_loopback(address) is local
