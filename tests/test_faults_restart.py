"""Preemption and restarts lose nothing: SIGTERM saves a checkpoint and exits 75 (and the job resumes
from it), and a killed rank restarts and ends on the uninterrupted run's weights, bit for bit. Jobs run
as real `zerotron train` processes."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from faults.soak import children, env, latest_step  # the soak test's launcher environment and probes

ROOT = Path(__file__).resolve().parent.parent


# ---- preemption and restarts ---------------------------------------------------------------------
TRAIN = [
    "--model",
    "tiny",
    "--nproc",
    "2",
    "--seq-len",
    "32",
    "--eval-batches",
    "1",
    "--sample-bytes",
    "0",
    "--corpus-bytes",
    "60000",
]


def test_sigterm_saves_a_checkpoint_and_exits_75(tmp_path):
    save = tmp_path / "ckpt"
    job = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "zerotron.cli",
            "train",
            *TRAIN,
            "--steps",
            "100000",
            "--save-dir",
            str(save),
            "--save-every",
            "1000000",
        ],
        cwd=ROOT,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        for line in job.stdout:  # the header is printed just before the first step
            if line.startswith("zerotron train:"):
                break
        time.sleep(3)
        os.killpg(job.pid, signal.SIGTERM)  # as a scheduler does: the launcher and every worker
        stdout, stderr = job.communicate(timeout=90)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode == 75, stderr[-3000:]
    assert "preempted: checkpoint saved at step" in stdout
    step = latest_step(save)
    assert step > 0
    resumed = subprocess.run(
        [
            sys.executable,
            "-m",
            "zerotron.cli",
            "train",
            *TRAIN,
            "--steps",
            str(step + 2),
            "--save-dir",
            str(save),
            "--resume",
            "auto",
        ],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {save / f'global_step{step}'} at step {step}" in resumed.stdout


def _weights(directory: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update({f"{f.name}/{k}": v for k, v in load_file(str(f)).items()})
    return out


def test_a_killed_rank_restarts_and_ends_on_the_uninterrupted_weights(tmp_path):
    steps = 40
    plain = tmp_path / "plain"
    ref = subprocess.run(
        [
            sys.executable,
            "-m",
            "zerotron.cli",
            "train",
            *TRAIN,
            "--steps",
            str(steps),
            "--save-dir",
            str(plain),
            "--save-every",
            "4",
        ],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert ref.returncode == 0, ref.stderr[-3000:]

    save = tmp_path / "elastic"
    job = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "zerotron.cli",
            "train",
            *TRAIN,
            "--steps",
            str(steps),
            "--save-dir",
            str(save),
            "--save-every",
            "4",
            "--max-restarts",
            "1",
            "--resume",
            "auto",
        ],
        cwd=ROOT,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 180
        while latest_step(save) < 8 and time.monotonic() < deadline and job.poll() is None:
            time.sleep(0.05)
        assert 8 <= latest_step(save) < steps, "the run ended before a worker could be killed"
        victim = children(job.pid)[-1]
        os.kill(victim, signal.SIGKILL)
        stdout, stderr = job.communicate(timeout=240)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert job.returncode == 0, stderr[-3000:]
    assert "resumed from" in stdout  # the second attempt continued from a checkpoint
    final = f"global_step{steps}"
    a, b = _weights(plain / final), _weights(save / final)
    assert a.keys() == b.keys() and a
    for k in a:
        assert torch.equal(a[k], b[k]), k  # bit for bit: same data order, nothing skipped or repeated
