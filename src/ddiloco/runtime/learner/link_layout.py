"""What a learner's link slots hold per fragment, and what its helper is told when it starts: the sizes follow from where Δ is compressed and
where updates are decoded (the core's fused passes on the CPU, the device on a GPU, else the helper)."""

from __future__ import annotations

import logging
import os
import threading

from ddiloco.core.learner_side.learner_core import Learner
from ddiloco.runtime.client import ClientSpec
from ddiloco.runtime.learner.helper_wire import HelperSpec
from ddiloco.runtime.learner.slots import SlotLayout
from ddiloco.runtime.learner.staging import HostStaging


def slot_layout(core: Learner, staging: HostStaging) -> SlotLayout:
    """Each fragment's slots, sized for the most they hold: out, the payload (or Δ as float32 where
    the helper compresses it); in, the payload (or the values, where the helper decodes them)."""
    uplink, downlink = core.codecs
    outs, ins = [], []
    for f in core.plan.fragments:
        fused_up = core.encodes_contributions(f.index) or staging.asynchronous
        outs.append(uplink.encoded_size(f.numel) if fused_up else max(uplink.encoded_size(f.numel), 4 * f.numel))
        ins.append(max(downlink.encoded_size(f.numel), 4 * f.numel if helper_decodes(core, staging, f.index) else 0))
    return SlotLayout(tuple(outs), tuple(ins))


def helper_decodes(core: Learner, staging: HostStaging, fragment: int) -> bool:
    """Does the helper decode this fragment's updates (into float32 in the slot)? Not where the core
    applies them from the payload in one pass, nor on a GPU (decoded there, ``staging.py``)."""
    return not core.decodes_updates(fragment) and not staging.asynchronous


def helper_spec(core: Learner, lock: threading.RLock, staging: HostStaging, clients: list[ClientSpec],
                layout: SlotLayout) -> HelperSpec:
    """What a new helper needs: the clients, the slots, the codecs, and the sessions the core holds."""
    with lock:
        sessions = tuple(link.session for link in core.links)
    fragments = core.plan.fragments
    return HelperSpec(core.learner_id, tuple(clients), layout, core.config.codec, core.config.downlink_codec,
                      core.config.block_size, tuple(f.numel for f in fragments),
                      tuple(helper_decodes(core, staging, f.index) for f in fragments), sessions,
                      core.boot, os.getpid(), logging.getLogger("ddiloco.learner").getEffectiveLevel())
