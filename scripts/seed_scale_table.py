"""Seed ``bench_scale.py``'s table for a run that goes on from an earlier session's results.

    python scripts/seed_scale_table.py docs/results/scale_gpu_b882afc.json OUT/table.json

A results table names the table it continued in ``previous`` (a file beside it); its own runs
alone may hold no data-parallel run at a gridded size (``scale_gpu_b882afc.json`` holds 8m data
parallel and 3m Decoupled DiLoCo, but the 3m data-parallel runs are in ``scale_gpu_bc7c667.json``),
and then a size that reuses a gridded size's best lr cannot be run from it. This follows the
``previous`` links and writes every run of the chain, newest first, as one table.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path


def chain(table: Path) -> list[dict]:
    """The runs of ``table`` and of the tables its ``previous`` names, recursively (newest first)."""
    runs: list[dict] = []
    seen: set[Path] = set()
    pending = [table]
    while pending:
        path = pending.pop(0).resolve()
        if path in seen:
            continue
        seen.add(path)
        data = json.loads(path.read_text())
        runs += data["runs"]
        for name in re.findall(r"[\w.-]+\.json", str(data.get("previous") or "")):
            if (path.parent / name).exists():
                pending.append(path.parent / name)
    return runs


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: seed_scale_table.py TABLE OUT_TABLE", file=sys.stderr)
        return 2
    source, out = Path(argv[0]), Path(argv[1])
    if not source.exists():
        print(f"seed_scale_table: no table at {source}", file=sys.stderr)
        return 2
    runs = chain(source)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"runs": runs}, indent=1) + "\n")
    print(f"seeded {out} with {len(runs)} runs from {source} and the tables it continues")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
