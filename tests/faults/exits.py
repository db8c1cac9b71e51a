"""Finished jobs exit 0: consecutive short `zerotron train` runs, counting their exit statuses.

    python tests/faults/exits.py --runs 50               # 50 8-rank 3D runs and 50 2-rank runs
    python tests/faults/exits.py --runs 1 --small 3      # what CI runs (tests/test_faults.py)

The 8-rank run is `--dp 2 --tp 2 --pp 2 --steps 3` and the 2-rank one ZeRO-2 in bf16, the two
layouts that used to end with "terminate called without an active exception" (SIGABRT at
teardown) now and then. Any non-zero status is printed with the last lines of the job's stderr.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from tools import processes, reporting  # noqa: E402

ARGS = (
    "--model",
    "tiny",
    "--seq-len",
    "32",
    "--eval-batches",
    "1",
    "--sample-bytes",
    "0",
    "--corpus-bytes",
    "300000",
    "--micro-batch",
    "2",
)
LAYOUTS = {
    "3d-8-ranks": ("--nproc", "8", "--dp", "2", "--tp", "2", "--pp", "2", "--grad-accum", "2", "--steps", "3"),
    "zero2-bf16-2-ranks": ("--nproc", "2", "--zero", "2", "--precision", "bf16", "--steps", "6"),
}


def run_once(layout: str, timeout: float = 300) -> tuple[int, str]:
    rc, _, err = processes.run_limited(
        [sys.executable, "-m", "zerotron.cli", "train", *ARGS, *LAYOUTS[layout]],
        timeout,
        processes.child_env(OMP_NUM_THREADS=1, PYTHONUNBUFFERED=1),
        cwd=ROOT,
    )
    return (-999, f"timed out after {timeout:.0f} s\n{err}") if rc is None else (rc, err)


def soak(runs: dict[str, int], log=print) -> dict:
    counts = {layout: collections.Counter() for layout in runs}
    for layout, n in runs.items():
        for i in range(n):
            start = time.monotonic()
            status, stderr = run_once(layout)
            counts[layout][status] += 1
            if status != 0:
                tail = "\n      ".join(stderr.strip().splitlines()[-6:])
                log(f"  {layout} run {i + 1}: exit {status} after {time.monotonic() - start:.0f} s\n      {tail}")
        log(
            f"{layout}: {counts[layout][0]} of {n} exited 0"
            + (
                f" (others: {dict((k, v) for k, v in counts[layout].items() if k != 0)})"
                if counts[layout][0] != n
                else ""
            )
        )
    return {layout: dict(c) for layout, c in counts.items()}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=50, help="8-rank 3D runs")
    p.add_argument("--small", type=int, default=None, help="2-rank runs (default: as many as --runs)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "exits.json"))
    args = p.parse_args()
    start = time.monotonic()
    counts = soak({"3d-8-ranks": args.runs, "zero2-bf16-2-ranks": args.small if args.small is not None else args.runs})
    result = {"counts": counts, "minutes": round((time.monotonic() - start) / 60, 1)}
    reporting.write_json("exits", result, args.out)
    print(json.dumps(result))
    sys.exit(0 if all(set(c) == {0} for c in counts.values()) else 1)


if __name__ == "__main__":
    main()
