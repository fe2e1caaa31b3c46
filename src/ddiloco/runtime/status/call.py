"""The Status call alone, for ``ddiloco status``: gRPC and the generated messages, no torch.

The learners' client (:mod:`ddiloco.runtime.client`) carries tensors and imports the protocol
core, torch with it (2-3 s of CPU); an operator's status must answer in well under a second.
"""

from __future__ import annotations

from typing import Any

import grpc

from ddiloco.core.shared.errors import DdilocoError
from ddiloco.runtime.auth import channel_credentials, client_metadata
from ddiloco.runtime.call_errors import credentials_refused, refusal_reason, unreachable
from ddiloco.runtime.proto import ddiloco_pb2 as pb
from ddiloco.runtime.proto import ddiloco_pb2_grpc as pb_grpc
from ddiloco.runtime.status.wire_form import status_to_dict


def status_dict(address: str, *, token: str | None, tls_ca: str | None, timeout_s: float, learner_offset: int = 0,
                learner_limit: int = 0) -> dict[str, Any]:
    """The synchronizer's status (one page of its learners) as ``ddiloco status --json`` prints it.

    Raises :class:`~ddiloco.runtime.call_errors.Unreachable` when it does not answer and
    DdilocoError (one line) when it refuses."""
    credentials = channel_credentials(tls_ca)
    channel = grpc.insecure_channel(address) if credentials is None else grpc.secure_channel(address, credentials)
    request = pb.StatusRequest(learner_offset=learner_offset, learner_limit=learner_limit)
    try:
        with channel:
            reply = pb_grpc.SynchronizerStub(channel).Status(request, timeout=timeout_s,
                                                             metadata=client_metadata(token))
    except grpc.RpcError as err:
        if line := credentials_refused(address, err):
            raise DdilocoError(line) from None
        reason = refusal_reason(err)
        if reason is None:
            raise unreachable(address, err) from None
        raise DdilocoError(f"the synchronizer at {address} refused the status call: {err.details() or reason}") from None
    return status_to_dict(reply)
