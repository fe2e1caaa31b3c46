"""How a failed gRPC call to the synchronizer reads, without torch: shared by the learners'
client (:mod:`ddiloco.runtime.client`) and the one call ``ddiloco status`` makes
(:mod:`ddiloco.runtime.status.call`), which must start in a fraction of a second.

The reason travels in the ``ddiloco-reason`` trailing metadata; a status without one is a
transport failure (unreachable), never a refusal with a reason made up here.
"""

from __future__ import annotations

import grpc

from ddiloco.runtime.auth import REASON_HEADER


class Unreachable(Exception):
    """The synchronizer did not answer (down, restarting, deadline exceeded)."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.code = code
        """gRPC's status, where the call failed in gRPC (``DEADLINE_EXCEEDED``: no answer in time)."""


def refusal_reason(err: grpc.RpcError) -> str | None:
    """The reason the synchronizer gave (its ``ddiloco-reason`` header); None: it never answered."""
    return next(((v.decode() if isinstance(v, bytes) else v) for k, v in err.trailing_metadata() or ()
                 if k == REASON_HEADER), None)


def credentials_refused(address: str, err: grpc.RpcError) -> str | None:
    """The one line for a call refused as ``unauthenticated`` (a wrong token or secret: retrying
    cannot help); None for any other failure."""
    if err.code() != grpc.StatusCode.UNAUTHENTICATED:
        return None
    return (f"the synchronizer at {address} refused our credentials ({err.details()}; check --token-file / "
            "$DDILOCO_TOKEN, or --secret-file / $DDILOCO_SECRET, on both sides)")


def unreachable(address: str, err: grpc.RpcError) -> Unreachable:
    return Unreachable(f"{address}: {err.code().name}: {err.details()}", err.code())
