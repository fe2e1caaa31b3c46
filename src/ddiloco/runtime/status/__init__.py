"""What a running synchronizer says of itself, in one place: the Status call and the status page.

The core decides what the status holds (:mod:`ddiloco.core.sync_side.status_snapshot`); the
synchronizer adds what only it measures (:mod:`ddiloco.runtime.sync.status_reply`); everything
after that, on either side of the wire, is here:

- :mod:`~ddiloco.runtime.status.wire_form`: the Status call's one conversion (the core's status to
  protobuf, protobuf to the dict ``ddiloco status --json`` prints), by field name;
- :mod:`~ddiloco.runtime.status.call`: the Status call alone (gRPC, no torch), so
  ``ddiloco status`` answers in well under a second;
- :mod:`~ddiloco.runtime.status.page_process`: the status page in a process of its own, fed a
  snapshot file, so a busy synchronizer never stalls it;
- :mod:`~ddiloco.runtime.status.page`: the live status page and its JSON (``--http-port``).
"""
