"""Measure the cited results again, in place, and say which figures moved.

Every results file under docs/results/ records the behaviour fingerprint it was measured at
(:mod:`stamp`); ``results_age.py`` lists those the tree's protocol decisions no longer match. This
runs their benchmarks again, one after the other, writing the stamped files where the docs cite
them, with a progress bar and an estimate of the time left, then prints every figure that moved
(a number in the old file and the new one at the same place, by more than ``--moved``):

    python benchmarks/refresh.py --only readme          # the files README.md cites
    python benchmarks/refresh.py --only stale           # every cited file whose fingerprint is not the tree's
    python benchmarks/refresh.py --only codecs_small.json --dry-run

A file is measured again by its :data:`RECIPES` entry, else by the command its stamp recorded when
that command is a benchmark writing the file in place (``--json docs/results/NAME``). A benchmark
that fails is reported with its last lines, its file left as it was, and the rest go on; the exit
status is 1 if any failed.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "docs" / "results"
README_SET = "readme"
STALE_SET = "stale"

RECIPES: dict[str, str] = {
    "ablations_small.json": "python benchmarks/bench_ablations.py --json docs/results/ablations_small.json",
    "bench_modes_failures_default_seeds0-1-2-3-4.json":
        "python benchmarks/bench_modes.py --part failures --out docs/results",
    "bench_modes_parity_default.json": "python benchmarks/bench_modes.py --part parity --out docs/results",
    "codecs_small.json": "python benchmarks/bench_codecs.py --json docs/results/codecs_small.json",
    "main_job_time.json": "python benchmarks/bench_main_job.py --json docs/results/main_job_time.json",
    "scavenging_processes.json": "python benchmarks/bench_scavenging.py --processes --preset small --budget 1 "
                                 "--seeds 2 --min-step-s 0.15 --json docs/results/scavenging_processes.json",
    "scavenging_virtual.json": "python benchmarks/bench_scavenging.py --preset small --budget 1 "
                               "--json docs/results/scavenging_virtual.json",
    "sweep_small.json": "python benchmarks/bench_sweep.py --json docs/results/sweep_small.json",
}
"""How each file README cites is measured (their stamps predate in-place commands)."""


def command_for(name: str) -> str | None:
    """The command that writes ``name`` in place, or None if neither a recipe nor its stamp says."""
    if name in RECIPES:
        return RECIPES[name]
    try:
        stamped = json.loads((RESULTS / name).read_text()).get("command", "")
    except (OSError, ValueError, AttributeError):
        return None
    words = shlex.split(stamped.split(" (")[0]) if isinstance(stamped, str) else []
    in_place = f"docs/results/{name}"
    if len(words) >= 2 and words[0] == "python" and words[1].startswith("benchmarks/") and in_place in words:
        return " ".join(shlex.quote(w) for w in words)
    return None


def chosen(only: list[str]) -> list[str]:
    """The files ``--only`` names: ``readme``, ``stale``, or file names."""
    from results_age import ages
    from stamp import tree_fingerprint

    rows = ages(tree_fingerprint()) if STALE_SET in only or README_SET in only else ages()
    names: list[str] = []
    for word in only:
        if word == README_SET:
            names += [a.path.name for a in rows if "README.md" in a.cited_by and a.history is None]
        elif word == STALE_SET:
            names += [a.path.name for a in rows if a.stale and a.cited_by]
        elif (RESULTS / word).exists():
            names.append(word)
        else:
            raise SystemExit(f"refresh.py: error: {word!r} is neither readme, stale nor a file in docs/results/")
    return list(dict.fromkeys(names))


def numbers(data: Any, at: str = "") -> Iterator[tuple[str, float]]:
    """Every number in a results file with its place (``runs[2].eval_loss``); stamps left out."""
    if isinstance(data, dict):
        for key, value in data.items():
            if key not in ("load", "load_at_end", "date", "commit", "fingerprint"):
                yield from numbers(value, f"{at}.{key}" if at else str(key))
    elif isinstance(data, list):
        for i, value in enumerate(data):
            yield from numbers(value, f"{at}[{i}]")
    elif isinstance(data, (int, float)) and not isinstance(data, bool):
        yield at, float(data)


def moved(old: Any, new: Any, threshold: float) -> list[tuple[str, float, float]]:
    """The figures present in both whose relative change exceeds ``threshold``, largest first."""
    before = dict(numbers(old))
    out = []
    for place, value in numbers(new):
        if place in before:
            was = before[place]
            change = abs(value - was) / max(abs(was), 1e-12)
            if change > threshold:
                out.append((place, was, value))
    return sorted(out, key=lambda m: -abs(m[2] - m[1]) / max(abs(m[1]), 1e-12))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", default=[STALE_SET], metavar="WHAT",
                        help="readme, stale (the default), or results file names")
    parser.add_argument("--moved", type=float, default=0.005, help="relative change that counts as moved (0.005)")
    parser.add_argument("--most", type=int, default=12, help="moved figures listed per file (12)")
    parser.add_argument("--dry-run", action="store_true", help="list what would run, run nothing")
    args = parser.parse_args(argv)
    out = Console()
    plan = [(name, command_for(name)) for name in chosen(args.only)]
    for name, command in plan:
        if command is None:
            out.print(f"[yellow]{name}: no recipe and no in-place command in its stamp: measure it by hand[/yellow]")
    plan = [(n, c) for n, c in plan if c is not None]
    if args.dry_run:
        for name, command in plan:
            out.print(f"{name}: {command}")
        return 0
    failed, report = [], []
    started = time.monotonic()
    progress = Progress(TextColumn("[bold]refresh"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                        TextColumn("{task.description}"), console=out)
    with progress:
        task = progress.add_task("", total=len(plan))
        for done, (name, command) in enumerate(plan):
            per_file_s = (time.monotonic() - started) / max(1, done)
            left = f" (about {per_file_s * (len(plan) - done) / 60:.0f} min left)" if done else ""
            progress.update(task, description=f"{name}{left}")
            path = RESULTS / name
            old = json.loads(path.read_text()) if path.exists() else None
            t0 = time.monotonic()
            run = subprocess.run(shlex.split(command), cwd=ROOT, capture_output=True, text=True)
            seconds = time.monotonic() - t0
            if run.returncode != 0:
                failed.append(name)
                tail = "\n".join((run.stdout + run.stderr).strip().splitlines()[-8:])
                out.print(f"[red]{name}: `{command}` failed (exit {run.returncode}) after {seconds:.0f} s[/red]")
                out.print(tail)
            else:
                report.append((name, seconds, moved(old, json.loads(path.read_text()), args.moved) if old else []))
            progress.advance(task)
    for name, seconds, changes in report:
        out.print(f"[bold]{name}[/bold] measured again in {seconds / 60:.1f} min; "
                  f"{len(changes)} figures moved by more than {args.moved:.1%}")
        for place, was, now in changes[:args.most]:
            out.print(f"  {place}: {was:.6g} -> {now:.6g}")
    out.print(f"{len(report)} measured, {len(failed)} failed, {(time.monotonic() - started) / 60:.1f} min in all")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
