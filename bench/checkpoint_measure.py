"""bench/checkpoint.py's measurements: sizes on disk, this process's RSS from /proc, the model's facts,
and child processes timed with their own peak RSS (run_child, through a torch-free LAUNCHER)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

from zerotron.models.gpt import GPT, config_for


# ---- helpers used in every phase ----------------------------------------------------------------------
def mib(n: float) -> float:
    return n / 2**20


def dir_bytes(path: Path) -> dict:
    files = [f for f in Path(path).rglob("*") if f.is_file()]
    return {
        "files": len(files),
        "bytes": sum(f.stat().st_size for f in files),
        "allocated_bytes": sum(f.stat().st_blocks * 512 for f in files),
    }


def proc_status() -> dict:
    """This process's VmRSS, VmHWM, RssAnon, RssFile in bytes."""
    text = Path("/proc/self/status").read_text()
    return {k: int(v) * 1024 for k, v in re.findall(r"^(VmRSS|VmHWM|RssAnon|RssFile):\s+(\d+) kB", text, re.M)}


def reset_peak():
    """Reset this process's VmHWM to its current RSS (Linux: write 5 to /proc/self/clear_refs)."""
    Path("/proc/self/clear_refs").write_text("5")


def mapped_rss(pattern: str) -> int:
    """Bytes resident in this process's mappings of files whose path matches `pattern` (from smaps)."""
    total, match = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
            parts = line.split(None, 5)
            match = len(parts) > 5 and re.search(pattern, parts[5]) is not None
        elif match and line.startswith("Rss:"):
            total += int(line.split()[1]) * 1024
    return total


def model_facts(size: str) -> dict:
    torch.manual_seed(0)
    model = GPT(config_for(size))
    params = dict(model.named_parameters())
    largest = max(params.items(), key=lambda kv: kv[1].numel())
    n = sum(p.numel() for p in params.values())
    return {
        "size": size,
        "params": n,
        "fp32_bytes": 4 * n,
        "tensors": len(params),
        "largest_tensor": largest[0],
        "largest_shape": list(largest[1].shape),
        "largest_fp32_bytes": 4 * largest[1].numel(),
    }


# A child's ru_maxrss is at least the RSS of the process that forked it (Linux records the old mm's
# high-water mark at exec, and a vfork/fork child's old mm is its parent's, ~300 MiB here with torch
# and a model loaded). So every measured command is started by this small torch-free launcher, which
# starts it, waits for it with wait4 and prints its ru_maxrss (KiB) and wall seconds as the last line.
LAUNCHER = """import os, sys, time
t0 = time.perf_counter()
pid = os.posix_spawn(sys.argv[1], sys.argv[1:], os.environ)
_, status, usage = os.wait4(pid, 0)
sys.stdout.flush()
print("LAUNCHER", os.waitstatus_to_exitcode(status), usage.ru_maxrss, time.perf_counter() - t0, flush=True)
"""


def run_child(cmd, env=None, launcher: bool = True) -> dict:
    """Run cmd; its wall seconds, exit code and its own peak RSS (ru_maxrss of exactly that process)."""
    t0 = time.perf_counter()
    full = [sys.executable, "-c", LAUNCHER, *cmd] if launcher else cmd
    p = subprocess.Popen(full, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out = p.stdout.read().decode(errors="replace")
    _, status, usage = os.wait4(p.pid, 0)
    p.stdout.close()
    res = {
        "seconds": time.perf_counter() - t0,
        "rc": os.waitstatus_to_exitcode(status),
        "maxrss_bytes": usage.ru_maxrss * 1024,
        "output": out,
    }
    if launcher:
        last = [line for line in out.splitlines() if line.startswith("LAUNCHER ")][-1].split()
        res.update(
            rc=int(last[1]),
            maxrss_bytes=int(last[2]) * 1024,
            seconds=float(last[3]),
            launcher_maxrss_bytes=usage.ru_maxrss * 1024,
        )
        res["output"] = out[: out.rfind("LAUNCHER ")]
    return res
