"""Child processes that cannot outlive their time limit, started in a world of their own.

Shared by the benchmarks (bench/), the GPU runbook (tools/gpu/) and the fault harnesses (tests/faults/):
spawn / wait_limited / run_limited (past the limit the child's whole process group is killed), child_env
(this environment without torchrun's variables) and torchrun_cmd.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

# What torchrun (and torch.distributed.elastic) set for its workers: a child that starts a world of its own
# must not inherit them.
LAUNCH_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "ROLE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
)


def child_env(**extra) -> dict:
    """This process's environment without torchrun's variables, plus `extra` (values made strings)."""
    return {**{k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}, **{k: str(v) for k, v in extra.items()}}


def torchrun_cmd(nproc: int, script, *args) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        str(script),
        *map(str, args),
    ]


def spawn(cmd, env=None, capture: bool = True, **popen) -> subprocess.Popen:
    """Start `cmd` in a session of its own (so that a time limit can kill all of it), output captured as text."""
    pipe = subprocess.PIPE if capture else None
    return subprocess.Popen(cmd, env=env, stdout=pipe, stderr=pipe, text=True, start_new_session=True, **popen)


def wait_limited(proc: subprocess.Popen, timeout: float) -> tuple[int | None, str, str]:
    """(exit status, or None when it ran past `timeout` seconds; stdout; stderr) of a spawn()ed process. Past the
    limit, or on ^C (re-raised), its whole process group is killed: nothing is left behind."""
    try:
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out or "", err or ""
    except BaseException as e:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        if not isinstance(e, subprocess.TimeoutExpired):
            raise
        return None, out or "", err or ""


def run_limited(cmd, timeout: float, env=None, capture: bool = True, **popen) -> tuple[int | None, str, str]:
    return wait_limited(spawn(cmd, env, capture, **popen), timeout)
