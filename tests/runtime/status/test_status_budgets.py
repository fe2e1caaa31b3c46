"""Issue 29: status shows every budget and what is left of it, on the command line and on the page.

A ``--time`` budget showed in status as ``token_budget: 0``, with no time budget nor time left.
"""

from __future__ import annotations

import asyncio
import json
import re

import pytest
from page_client import CHROMIUM, api_status, browse

from ddiloco import cli
from ddiloco.core.shared.messages import Heartbeat, Join, Progress
from ddiloco.runtime.auth import Address
from ddiloco.runtime.client import SyncClient
from ddiloco.runtime.status.page_process import StatusPageProcess
from ddiloco.runtime.status.wire_form import status_to_dict
from ddiloco.settings.config_sources import build_config
from ddiloco.testing import wait_for


@pytest.mark.parametrize("budget", ["run.time_s=600", "run.tokens=100000"])
def test_status_shows_the_budget_and_what_is_left_of_it(inproc_sync, capsys, budget):
    """``ddiloco status`` and its ``--json``."""
    key, value = budget.split("=")
    s = inproc_sync(build_config(preset="tiny", overrides=("run.learners=2", f"{key}={value}")))
    with SyncClient(f"127.0.0.1:{s.port}") as client:
        session = client.join(Join("learner-0", "boot")).state.session
        client.heartbeat(Heartbeat("learner-0", session, Progress("boot", tokens=256, steps=1)))
    assert cli.main(["status", f"127.0.0.1:{s.port}", "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert cli.main(["status", f"127.0.0.1:{s.port}"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    if key == "run.time_s":
        assert status["time_budget_s"] == 600 and status["token_budget"] == 0
        assert 0 <= status["elapsed_s"] < 60
        assert status["time_left_s"] == pytest.approx(600 - status["elapsed_s"], abs=1)
        assert re.search(r"run time \d+s of 600s \(\d+s left\)", text), text
    else:
        assert status["token_budget"] == 100_000 and status["time_budget_s"] == 0
        assert status["tokens_left"] == 100_000 - status["tokens"] and status["tokens"] > 0
        assert f"tokens {status['tokens']:,} of 100,000 ({status['tokens_left']:,} left)" in text, text


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary on PATH (apt-get install chromium)")
@pytest.mark.parametrize("budget, shown", [
    ("run.time_s=600", r"run time of 10\.0 min, (10\.0|9\.\d) min left"),
    ("run.tokens=100000", r"tokens of 100k, 100k left"),
])
def test_the_page_shows_each_budget_and_what_is_left(inproc_sync, tmp_path, budget, shown) -> None:
    """The page showed a token budget only: a ``--time`` run's budget and time left were nowhere."""
    s = inproc_sync(build_config(preset="tiny", overrides=("run.learners=2", budget)))
    with SyncClient(f"127.0.0.1:{s.port}") as client:
        client.join(Join("learner-0", "boot"))  # the run's clock starts

    async def status() -> dict:
        return status_to_dict(await s.service.status_reply())

    page = StatusPageProcess(Address("127.0.0.1", 0), token=None)
    feed = asyncio.run_coroutine_threadsafe(page.publish(status), s.loop)
    try:
        wait_for(lambda: api_status(page.port), "the page's first status")
        dom = browse(page.url, tmp_path / "chromium", "--dump-dom")
    finally:
        feed.cancel()
        page.close()
    figures = " ".join(re.sub(r"<[^>]+>", " ", dom).split())
    assert re.search(shown, figures), figures
