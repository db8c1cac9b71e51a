"""Where results go and what they record: the environment of a run (versions, machine, zerotron's
commit, load), text tables, JSON files.

Shared by the benchmarks (bench/), the GPU runbook (tools/gpu/) and the fault harnesses (tests/faults/).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
LOADAVG_START = os.getloadavg()[0]


def zerotron_source() -> dict:
    """The zerotron commit measured, and whether its files had uncommitted changes."""
    try:
        git = ["git", "-C", str(ROOT)]
        commit = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run([*git, "status", "--porcelain", "zerotron"], capture_output=True, text=True).stdout
        return {"zerotron_commit": commit, "zerotron_uncommitted_changes": bool(dirty.strip())}
    except OSError:
        return {}


def environment(**extra) -> dict:
    """Versions, machine, threads, the process group (when there is one), the zerotron commit and the load
    average at the start (this module's import) and now."""
    import zerotron

    versions = {"zerotron": getattr(zerotron, "__version__", "?")}
    if "deepspeed" in sys.modules:
        versions["deepspeed"] = getattr(sys.modules["deepspeed"], "__version__", "?")
    group = {"world_size": dist.get_world_size(), "backend": dist.get_backend()} if dist.is_initialized() else {}
    return {
        "torch": torch.__version__,
        **versions,
        "python": platform.python_version(),
        "cpu_cores": os.cpu_count(),
        "omp_threads": torch.get_num_threads(),
        **group,
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": platform.machine(),
        "platform": platform.platform(),
        **zerotron_source(),
        "loadavg_start": LOADAVG_START,
        "loadavg_end": os.getloadavg()[0],
        **extra,
    }


def table_lines(
    rows: list[dict], columns: list[tuple[str, str, str]], missing: str = "", rule: bool = True, indent: str = ""
) -> list[str]:
    """rows: dicts; columns: (key, header, format) e.g. ("median_ms", "median ms", "{:.1f}"); a value that is
    None or absent shows as `missing`. The first column is left-aligned, the others right-aligned."""
    cells = [[h for _, h, _ in columns]] + [
        [missing if r.get(k) is None else f.format(r[k]) for k, _, f in columns] for r in rows
    ]
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    lines = [
        indent + "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths)))
        for line in cells
    ]
    return lines[:1] + [indent + "  ".join("-" * w for w in widths)] * rule + lines[1:]


def json_args(args) -> dict:
    return {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}


def write_json(name: str, payload: dict, path: Path | None = None) -> Path:
    path = Path(path or RESULTS / f"{name}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    return path
