"""The wire between learners and the synchronizer: message sizes, channel options, conversions.

Client and server both import from here, so neither depends on the other's module.
"""

from __future__ import annotations

CHUNK_BYTES = 1 << 20
"""Payload bytes per streamed message: far below gRPC's 4 MiB default message limit."""
MAX_MESSAGE_BYTES = CHUNK_BYTES + (64 << 10)
KEEPALIVE_OPTIONS = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
