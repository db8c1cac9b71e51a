"""Soak test: many short 2-rank jobs with random faults, counting what survives.

Each job (tests/faults/soak_job.py, a DeepSpeed-style script under `zerotron run --max-restarts 2`;
no restarts for the faults that must stop the job) trains the tiny GPT with checkpoints every 2
steps. One fault is drawn per job:

    none      nothing happens                         expect: finishes
    kill      SIGKILL one worker mid-run              expect: restarts from the newest checkpoint, finishes
    sigterm   SIGTERM the whole job mid-run           expect: exit 75 with a checkpoint; a rerun finishes
    nan       rank 1's loss is NaN for one step       expect: that step skipped, finishes
    nan3      ... for three steps in a row            expect: stops with NonFiniteError
    diverge   rank 1 skips a step (another branch)    expect: exit 70 within the collective timeout

After every job the newest checkpoint must be complete (meta.json and every file's SHA-256) and
no older than the last one written before the fault. Counted: jobs, outcomes as expected, hangs
(a job still running after --job-timeout) and checkpoints lost (goal: 0 and 0).

    python tests/faults/soak.py --minutes 10
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tools/ (and zerotron) from this checkout

from tools import processes, reporting  # noqa: E402

JOB = Path(__file__).resolve().parent / "soak_job.py"
FAULTS = ("none", "kill", "sigterm", "nan", "nan3", "diverge")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0, help="stop starting jobs after this long")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--job-timeout", type=float, default=180.0, help="a job running longer than this is a hang")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="result JSON (default bench/results/soak.json)")
    return p.parse_args()


def env():
    """The environment of a job started from here (or from a test): its own world, one thread per rank."""
    return processes.child_env(OMP_NUM_THREADS=1, PYTHONUNBUFFERED=1)


def latest_step(save: Path) -> int:
    try:
        return int((save / "latest").read_text().strip().removeprefix("global_step"))
    except (OSError, ValueError):
        return -1


def checkpoint_intact(save: Path) -> bool:
    """The newest checkpoint is complete: meta.json lists every rank file, each with its checksum."""
    from zerotron.checkpoint.files import read_meta, verify

    if latest_step(save) < 0:
        return True  # nothing written yet is not a loss
    tag = save / (save / "latest").read_text().strip()
    try:
        meta = read_meta(tag)
        for name in meta["files"]:
            verify(tag, meta, name)
        return True
    except Exception as e:  # noqa: BLE001
        print(f"    checkpoint damaged: {e}")
        return False


def children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                pass
    return out


def launch(save: Path, steps: int, extra: list[str], restarts: int = 2) -> subprocess.Popen:
    return processes.spawn(
        [
            sys.executable,
            "-m",
            "zerotron.cli",
            "run",
            "-n",
            "2",
            "--max-restarts",
            str(restarts),
            str(JOB),
            "--save-dir",
            str(save),
            "--steps",
            str(steps),
            *extra,
        ],
        env(),
    )


def one_job(fault: str, rng: random.Random, args, root: Path) -> dict:
    save = root / f"job{rng.randrange(10**9)}"
    extra = []
    if fault == "nan":
        extra = ["--nan-steps", str(rng.randrange(2, args.steps - 2))]
    elif fault == "nan3":
        k = rng.randrange(2, args.steps - 4)
        extra = ["--nan-steps", f"{k},{k + 1},{k + 2}"]
    elif fault == "diverge":
        extra = ["--skip-step", str(rng.randrange(1, args.steps - 1))]
    start = time.monotonic()
    # Deliberate stops (a NaN streak, a diverging rank) must stop the job, not be restarted away.
    job = launch(save, args.steps, extra, restarts=0 if fault in ("nan3", "diverge") else 2)
    saved_before_fault = -1
    if fault in ("kill", "sigterm"):
        target = rng.randrange(2, args.steps - 4, 2)
        while latest_step(save) < target and job.poll() is None and time.monotonic() - start < args.job_timeout:
            time.sleep(0.02)
        time.sleep(rng.uniform(0, 0.3))
        saved_before_fault = latest_step(save)
        if job.poll() is None:
            if fault == "kill" and children(job.pid):
                os.kill(rng.choice(children(job.pid)), signal.SIGKILL)
            elif fault == "sigterm":
                os.killpg(job.pid, signal.SIGTERM)
    code, out, err = processes.wait_limited(job, args.job_timeout - (time.monotonic() - start))
    record = {
        "fault": fault,
        "args": extra,
        "exit": code,
        "seconds": round(time.monotonic() - start, 1),
        "hang": code is None,
    }
    if fault == "sigterm" and code == 75:  # preempted: the rerun must finish from the checkpoint
        record["preempted_at"] = latest_step(save)
        code2, out, err = processes.wait_limited(launch(save, args.steps, []), args.job_timeout)
        record["rerun_exit"] = code2
        record["hang"] |= code2 is None
        code = code2
    finished = "FINISHED at step" in out
    expected = {
        "none": finished,
        "kill": finished,
        "sigterm": finished,
        "nan": finished and "skipped 1" in out,
        "nan3": code not in (0, None) and "NonFiniteError" in err,
        "diverge": code == 70 and "collective timeout" in err,
    }[fault]
    record["as_expected"] = bool(expected)
    record["checkpoint_lost"] = not checkpoint_intact(save) or latest_step(save) < saved_before_fault
    if not expected:
        record["stderr_tail"] = err[-1500:]
    return record


def main():
    args = parse_args()
    rng = random.Random(args.seed)
    deadline = time.monotonic() + args.minutes * 60
    records = []
    with tempfile.TemporaryDirectory(prefix="zerotron-soak-") as tmp:
        while time.monotonic() < deadline:
            fault = FAULTS[len(records) % len(FAULTS)] if len(records) < len(FAULTS) else rng.choice(FAULTS)
            r = one_job(fault, rng, args, Path(tmp))
            records.append(r)
            print(
                f"job {len(records):3d} {fault:8s} exit {r['exit']} in {r['seconds']:5.1f}s  "
                f"{'ok' if r['as_expected'] else 'UNEXPECTED'}{'  HANG' if r['hang'] else ''}"
                f"{'  CHECKPOINT LOST' if r['checkpoint_lost'] else ''}",
                flush=True,
            )
    summary = {
        "jobs": len(records),
        "as_expected": sum(r["as_expected"] for r in records),
        "hangs": sum(r["hang"] for r in records),
        "checkpoints_lost": sum(r["checkpoint_lost"] for r in records),
        "by_fault": {f: sum(r["fault"] == f for r in records) for f in FAULTS},
    }
    print(json.dumps(summary, indent=1))
    reporting.write_json("soak", {"args": reporting.json_args(args), "summary": summary, "jobs": records}, args.out)


if __name__ == "__main__":
    main()
