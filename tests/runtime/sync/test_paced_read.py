"""Issue 57, item 4: on Ctrl-C of a launch the synchronizer's log said "Task exception was never
retrieved ... exception=StopAsyncIteration()". An upload's read of its next message ran as a task of
its own (``Paced.__anext__``, ``runtime/sync/call_limits.py``); cancelled while it waited (the stop
cancels the calls), the call left that read running, and when the client went away the stream
ended in it with nobody to retrieve the outcome. No sockets here: the stream is an async generator."""

from __future__ import annotations

import asyncio
import gc

from ddiloco.core.shared.protocol_config import ProtocolConfig
from ddiloco.runtime.sync.call_limits import CallLimits


async def a_call_cancelled_while_its_read_waits() -> list[dict]:
    loop = asyncio.get_running_loop()
    logged: list[dict] = []
    loop.set_exception_handler(lambda _loop, context: logged.append(context))
    client_gone = asyncio.Event()

    async def requests():  # the upload's messages: none, then the stream ends when the client goes
        await client_gone.wait()
        return
        yield b""  # makes this an async generator

    paced = CallLimits(ProtocolConfig(), max_learners=2).paced(requests())
    call = asyncio.ensure_future(paced.__anext__())
    for _ in range(3):
        await asyncio.sleep(0)  # the call starts its read, which waits for a message
    call.cancel()  # the synchronizer stops: its calls are cancelled
    for _ in range(3):
        await asyncio.sleep(0)
    client_gone.set()
    for _ in range(3):
        await asyncio.sleep(0)
    gc.collect()  # a task whose exception no one retrieved says so when it is collected
    return logged


def test_a_call_cancelled_while_its_read_waits_leaves_no_unretrieved_task_exception():
    logged = asyncio.run(a_call_cancelled_while_its_read_waits())
    assert not logged, [c.get("message") for c in logged]
