"""Shared pieces of the side-by-side benchmarks: launch, model, data, timing, memory, reporting.

Every benchmark runs all of its systems in ONE torchrun job on the same model, data and process
count, alternating the systems in rounds so that a noisy machine slows them all alike.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

RESULTS = Path(__file__).resolve().parent / "results"

_SYNCS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.__bool__,
          torch.Tensor.__int__, torch.Tensor.__float__}


class SyncCounter(TorchFunctionMode):
    """Counts the calls that make the host wait for the device (.item(), .tolist(), bool(t), ...),
    each with the zerotron line it came from: on a CPU, where nothing has to wait, this is how a
    test sees the syncs a GPU would pay for."""

    def __init__(self):
        super().__init__()
        self.where = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _SYNCS:
            frame = next((f for f in reversed(traceback.extract_stack()[:-1]) if "/zerotron/" in f.filename), None)
            self.where.append(f"{func.__name__} at {frame.filename.rsplit('/zerotron/', 1)[-1]}:{frame.lineno}"
                              if frame else func.__name__)
        return func(*args, **(kwargs or {}))


# ---- launch -------------------------------------------------------------------------------------
def relaunch_under_torchrun(nproc: int) -> None:
    """Re-execute this script under `torchrun --standalone` (one thread per rank) unless it already is."""
    if "RANK" in os.environ:
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu")}
    # Leave --nproc out of the script's arguments: torchrun's parser would take it for an abbreviation
    # of its own --nproc-per-node ("ambiguous option"), and under torchrun the script does not need it.
    rest, skip = [], False
    for a in sys.argv[1:]:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            rest.append(a)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           sys.argv[0], *rest]
    sys.exit(subprocess.call(cmd, env=env))


def init_gloo() -> tuple[int, int]:
    """Join torchrun's group on gloo with one intra-op thread; returns (rank, world size)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", 1)))
    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=10))
    return dist.get_rank(), dist.get_world_size()


def optional_import(name: str):
    """The module, or None when it is not installed (benchmarks skip that peer and say so)."""
    try:
        return __import__(name)
    except ImportError:
        return None


def base_parser(description: str, steps: int = 2, rounds: int = 15) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--steps", type=int, default=steps, help="timed steps per system per round")
    p.add_argument("--rounds", type=int, default=rounds, help="rounds; each round runs every system once")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per system before the rounds")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8, help="sequences per step, globally")
    p.add_argument("--nproc", type=int, default=2, help="ranks to launch when not already under torchrun")
    p.add_argument("--out", type=Path, default=None, help="result JSON (default bench/results/<name>.json)")
    return p


# ---- model and data -------------------------------------------------------------------------------
ADAMW = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}  # every system, every benchmark


def start(args):
    """Relaunch under torchrun if needed, join gloo; returns (rank, world, log, GPT config)."""
    relaunch_under_torchrun(args.nproc)
    rank, world = init_gloo()
    log = print if rank == 0 else (lambda *a, **k: None)
    return rank, world, log, gpt_config(args)


def zerotron_step(model, per_rank: int, clip: float, adamw: dict = ADAMW, **config):
    """A zerotron engine on `model` (AdamW as every system) and its one-step function; `config`
    adds or overrides sections of the DeepSpeed config."""
    import zerotron
    engine, *_ = zerotron.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": per_rank, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
        "zero_optimization": {"stage": 0}, "gradient_clipping": clip,
        "optimizer": {"type": "AdamW", "params": {**adamw, "betas": list(adamw["betas"])}}, **config})

    def step(tokens, targets):
        loss = engine(tokens, targets)
        engine.backward(loss)
        engine.step()
        return loss.item()
    return engine, step


def gpt_config(args):
    from zerotron.models.gpt import GPTConfig
    return GPTConfig(n_layer=args.layers, n_head=args.heads, n_kv_head=args.heads, d_model=args.d_model,
                     max_seq_len=args.seq, vocab_size=256)


def build_gpt(cfg, seed: int = 0) -> torch.nn.Module:
    """The reference GPT with seeded (so identical on every rank and for every system) fp32 weights."""
    from zerotron.models.gpt import GPT
    torch.manual_seed(seed)
    return GPT(cfg)


def make_batches(n: int, global_batch: int, seq: int, vocab: int, rank: int, world: int, seed: int = 1234):
    """`n` steps of (tokens, targets); this rank's contiguous slice of each global batch of random bytes."""
    if global_batch % world:
        raise SystemExit(f"--batch {global_batch} must be divisible by the {world} ranks")
    g = torch.Generator().manual_seed(seed)
    per = global_batch // world
    out = []
    for _ in range(n):
        data = torch.randint(0, vocab, (global_batch, seq + 1), generator=g)
        mine = data[rank * per:(rank + 1) * per]
        out.append((mine[:, :-1].contiguous(), mine[:, 1:].contiguous()))
    return out


# ---- timing ---------------------------------------------------------------------------------------
def run_rounds(systems: dict[str, Callable], batches, warmup: int, steps: int, rounds: int, log=print):
    """Run every system `warmup` untimed steps, then `rounds` rounds of `steps` timed steps each.

    A system is `step(tokens, targets) -> float loss` and keeps its own state, so all systems see
    batch k at their k-th step. The order of systems rotates each round. Each step is bracketed by
    barriers, so its time is that of the slowest rank. Returns {name: {"ms": [...], "losses": [...],
    "round_ms": [median per round]}}; "losses" holds every step's local loss, warm-up included.
    """
    names = list(systems)
    res = {n: {"ms": [], "losses": [], "round_ms": []} for n in names}

    def one_step(name, timed):
        tokens, targets = batches[len(res[name]["losses"])]
        dist.barrier()
        t0 = time.perf_counter()
        loss = systems[name](tokens, targets)
        dist.barrier()
        ms = (time.perf_counter() - t0) * 1e3
        res[name]["losses"].append(float(loss))
        if timed:
            res[name]["ms"].append(ms)
        return ms

    for name in names:
        for _ in range(warmup):
            one_step(name, timed=False)
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            ms = [one_step(name, timed=True) for _ in range(steps)]
            res[name]["round_ms"].append(statistics.median(ms))
        log(f"round {r + 1}/{rounds}: " + ", ".join(f"{n} {res[n]['round_ms'][-1]:.1f} ms" for n in names))
    # One rank's clock is enough (the barriers line the ranks up); average anyway so rank 0 reports both.
    for name in names:
        for key in ("ms", "losses"):
            t = torch.tensor(res[name][key], dtype=torch.float64)
            dist.all_reduce(t)
            res[name][key + ("_mean_over_ranks" if key == "losses" else "")] = (t / dist.get_world_size()).tolist()
        res[name]["median_ms"] = statistics.median(res[name]["ms"])
    return res


def paired_ratio(res: dict, a: str, b: str) -> float:
    """Median over rounds of a's round median / b's: robust to load that drifts between rounds."""
    return statistics.median(x / y for x, y in zip(res[a]["round_ms"], res[b]["round_ms"]))


def max_loss_diff(a: list[float], b: list[float], start: int = 0) -> tuple[float, float]:
    """(max |a-b|, max |a-b|/|b|) over steps[start:]."""
    pairs = list(zip(a[start:], b[start:]))
    return (max(abs(x - y) for x, y in pairs), max(abs(x - y) / abs(y) for x, y in pairs))


# ---- memory ---------------------------------------------------------------------------------------
def tensor_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one buffer count once)."""
    seen, total = set(), 0
    for t in tensors:
        if not torch.is_tensor(t):
            continue
        if hasattr(t, "to_local"):  # DTensor: this rank's shard
            t = t.to_local()
        s = t.untyped_storage()
        if s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


def model_state_bytes(params, optimizer, extra: int = 0) -> dict[str, int]:
    """This rank's params, grads and optimizer-state bytes (plus `extra`, e.g. communication buckets)."""
    params = list(params)
    out = {"params": tensor_bytes(params), "grads": tensor_bytes(p.grad for p in params),
           "optimizer": tensor_bytes(v for s in optimizer.state.values() for v in s.values()),
           "buffers": extra}
    out["total"] = sum(out.values())
    return out


def measure_after_first_step(optimizer, params, extra=lambda: 0) -> dict:
    """A dict that the optimizer's first step() fills with model_state_bytes: the moment grads and
    optimizer state both exist, whatever the system does with grads afterwards."""
    out = {}

    def hook(opt, *_):
        out.update(model_state_bytes(params(), opt, extra()))
        handle.remove()
    handle = optimizer.register_step_post_hook(hook)
    return out


# ---- reporting ------------------------------------------------------------------------------------
def environment() -> dict:
    versions = {m: getattr(sys.modules[m], "__version__", "?") for m in ("zerotron", "deepspeed") if m in sys.modules}
    return {"torch": torch.__version__, **versions, "python": platform.python_version(), "cpu_cores": os.cpu_count(),
            "omp_threads": torch.get_num_threads(), "world_size": dist.get_world_size(),
            "backend": dist.get_backend(), "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "machine": platform.machine(), "platform": platform.platform(), "loadavg_start": os.getloadavg()[0]}


def print_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> None:
    """rows: dicts; columns: (key, header, format) e.g. ("median_ms", "median ms", "{:.1f}")."""
    cells = [[h for _, h, _ in columns]] + [
        ["" if r.get(k) is None else f.format(r[k]) for k, _, f in columns] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    for j, line in enumerate(cells):
        print("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths))))
        if j == 0:
            print("  ".join("-" * w for w in widths))


def write_json(name: str, payload: dict, path: Path | None = None) -> Path:
    path = path or RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path
