"""Reading the status page as an operator does: its JSON over plain HTTP, and the page in headless Chromium."""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

from ddiloco.testing import DEADLINE_S


def get(url: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0, b""


def api_status(http_port: int) -> dict | None:
    code, body = get(f"http://127.0.0.1:{http_port}/api/status")
    return json.loads(body) if code == 200 else None


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


def browse(url: str, profile: Path, *extra: str) -> str:
    """Load ``url`` in headless Chromium, let its scripts run, return stdout (the DOM with --dump-dom)."""
    assert CHROMIUM is not None
    done = subprocess.run([CHROMIUM, "--headless", "--disable-gpu", "--no-sandbox", "--no-first-run",
                           f"--user-data-dir={profile}", "--virtual-time-budget=3000", *extra, url],
                          capture_output=True, text=True, timeout=DEADLINE_S)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout
