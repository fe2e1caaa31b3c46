"""Regenerate docs/quickstart.md's sample output from a real run of the command it shows.

Runs ``ddiloco run --preset tiny`` (the quickstart's command, seed 0) in a scratch directory,
keeps its ``summary.json`` and the second line of its ``metrics.jsonl`` in
``docs/results/quickstart_tiny.json`` (stamped with commit, date, machine and torch), and
rewrites the doc's two sample blocks from that file: the table and "what happened" panel as a
120-column terminal shows them, and the metrics line. ``tests/test_quickstart_sample.py``
checks the doc against the file (fast) and the file against a fresh run (slow), so a change
that moves the figures fails a test until this script is run again::

    python scripts/quickstart_sample.py
"""

from __future__ import annotations

import io
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from ddiloco.commands.display import print_report, what_happened
from ddiloco.settings.config_sources import build_config

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "quickstart.md"
RESULTS = ROOT / "docs" / "results" / "quickstart_tiny.json"
COMMAND = ("run", "--preset", "tiny")
TERMINAL_COLUMNS = 120
REPORT_OPENS = "on a 120-column terminal:\n\n```\n"
METRICS_OPENS = "The second line of the `tiny` run's `metrics.jsonl`:\n\n```json\n"
WROTE = "wrote runs/decoupled/summary.json, metrics.jsonl, config.toml, plot.png"


def run_quickstart(workdir: Path) -> dict[str, Any]:
    """The quickstart's command, run in ``workdir``: its summary and the second metrics line."""
    subprocess.run([sys.executable, "-m", "ddiloco.cli", *COMMAND], cwd=workdir, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    out = workdir / "runs" / "decoupled"
    return {"summary": json.loads((out / "summary.json").read_text()),
            "metrics_line": (out / "metrics.jsonl").read_text().splitlines()[1]}


def render_report(summary: dict[str, Any]) -> str:
    """What the command prints at its end on a 120-column terminal (trailing spaces dropped)."""
    buffer = io.StringIO()
    out = Console(file=buffer, width=TERMINAL_COLUMNS)
    slow_factor = build_config(preset="tiny", main_job=True).cluster.slow_factor
    print_report([summary], f"ddiloco run (tiny preset, seed {summary['seed']})",
                 what_happened(summary, slow_factor=slow_factor), out=out)
    lines = buffer.getvalue().splitlines() + [WROTE]
    return "\n".join(line.rstrip() for line in lines)


def _block(text: str, opens: str) -> tuple[int, int]:
    start = text.index(opens) + len(opens)
    return start, text.index("\n```", start)


def doc_samples(text: str) -> tuple[str, str]:
    """The doc's report block and its metrics line."""
    return tuple(text[slice(*_block(text, opens))] for opens in (REPORT_OPENS, METRICS_OPENS))  # type: ignore[return-value]


def with_samples(text: str, report: str, metrics_line: str) -> str:
    for opens, sample in ((REPORT_OPENS, report), (METRICS_OPENS, metrics_line)):
        start, end = _block(text, opens)
        text = text[:start] + sample + text[end:]
    return text


def main() -> int:
    with tempfile.TemporaryDirectory() as scratch:
        results = run_quickstart(Path(scratch))
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    import torch

    results = {"command": "ddiloco " + " ".join(COMMAND), "commit": commit,
               "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               "machine": f"{platform.machine()} {platform.processor() or platform.platform()}",
               "torch": torch.__version__, "load": [round(x, 2) for x in os.getloadavg()], **results}
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    DOC.write_text(with_samples(DOC.read_text(), render_report(results["summary"]), results["metrics_line"]))
    print(f"wrote {RESULTS.relative_to(ROOT)} and the samples in {DOC.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
