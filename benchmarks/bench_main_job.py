"""The README's main job on its defaults, timed: ``ddiloco run`` as a user starts it, in a process
of its own (the interpreter's start-up and the kernels' first compilation included).

    python benchmarks/bench_main_job.py --json docs/results/main_job_time.json
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from stamp import load_now, stamp


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, required=True, help="where the stamped result goes")
    args = parser.parse_args(argv)
    result = stamp(__file__, argv)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        started = time.monotonic()
        subprocess.run([sys.executable, "-m", "ddiloco.cli", "run", "--out", str(out)], check=True,
                       stdout=subprocess.DEVNULL)
        real_s = time.monotonic() - started
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        summary = json.loads((out / "summary.json").read_text())
    result.update({
        "load_at_end": load_now(),
        "real_s": round(real_s, 1), "user_s": round(usage.ru_utime, 1), "sys_s": round(usage.ru_stime, 1),
        "eval_loss": summary["eval_loss"], "weights_sha256": summary["weights_sha256"], "tokens": summary["tokens"],
        "summary_wall_time_s": summary.get("wall_time_s"),
    })
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"ddiloco run: {real_s:.0f} s ({usage.ru_utime:.0f} s of CPU), eval loss {summary['eval_loss']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
