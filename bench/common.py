"""The benchmark harness: launch, model and data, rounds, comparison, memory, reporting.

A side-by-side benchmark runs all of its systems in ONE torchrun job on the same seeded model, data and
process count, alternating them in rounds so that a noisy machine slows them all alike. A script only
describes its systems (each a `step(tokens, targets) -> float loss` keeping its own state):

    args = common.base_parser(__doc__.splitlines()[0]).parse_args()
    rank, world, log, cfg = common.start(args)        # re-executes itself under torchrun, joins gloo
    engine, systems["zt"] = training.zerotron_step(common.build_gpt(cfg), args.batch // world, clip=0.0)
    systems["ddp"] = training.torch_step(DDP(common.build_gpt(cfg)), opt)
    res = common.run_rounds(systems, common.batches_for(args, cfg, rank, world), args.warmup, args.steps,
                            args.rounds, log)         # warm-up, then rounds in rotating order, between barriers
    rows = common.compare(res, "ddp", start=args.warmup)   # medians and max |loss difference| vs a baseline
    if rank == 0: common.print_table(list(rows.values()), [("system", "system", "{}"), ...])
    common.finish("dp", args, {"results": ...}, rank)  # rank 0 writes bench/results/dp.json; leaves the job

Launch: base_parser, names_arg, start (relaunch_under_torchrun, init_gloo), load_deepspeed. Model and data:
gpt_config, build_gpt, to_pipeline, batches_for. Rounds: rounds (any entries), run_rounds (ranks). Results:
compare, pair, paired_ratio, max_loss_diff, max_over_ranks. Memory: tensor_bytes, model_state_bytes,
measure_after_first_step. Reporting: announce, model_json, print_table, finish.

What the GPU runbook and the tests use too lives in tools/: the systems, batches and FLOPs
(tools/training.py), child processes under time limits (tools/processes.py), the environment, tables and
JSON files (tools/reporting.py).
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # tools/ (and zerotron) from this checkout
from tools.processes import child_env, torchrun_cmd  # noqa: E402
from tools.reporting import environment, json_args, table_lines, write_json  # noqa: E402
from tools.training import gpt_shape, make_batches  # noqa: E402


# ---- launch ---------------------------------------------------------------------------------------
def relaunch_under_torchrun(nproc: int) -> None:
    """Re-execute this script under `torchrun --standalone` (one thread per rank) unless it already is."""
    if "RANK" in os.environ:
        return
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
    env = child_env(OMP_NUM_THREADS=1, DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "cpu"))
    sys.exit(subprocess.call(torchrun_cmd(nproc, sys.argv[0], *rest), env=env))


def init_gloo() -> tuple[int, int]:
    """Join torchrun's group on gloo with one intra-op thread; returns (rank, world size)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", 1)))
    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=10))
    return dist.get_rank(), dist.get_world_size()


def start(args):
    """Relaunch under torchrun if needed, join gloo; returns (rank, world, log (rank 0 prints), GPT config)."""
    relaunch_under_torchrun(args.nproc)
    rank, world = init_gloo()
    return rank, world, (print if rank == 0 else (lambda *a, **k: None)), gpt_config(args)


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


def names_arg(text: str, allowed, what: str = "systems") -> list[str]:
    """A comma-separated subset of `allowed` (empty: all), in the order given; exits on an unknown name."""
    names = [s.strip() for s in text.split(",") if s.strip()] or list(allowed)
    unknown = sorted(set(names) - set(allowed))
    if unknown:
        raise SystemExit(f"unknown {what} {unknown}; choose from {', '.join(allowed)}")
    return names


def load_deepspeed(args, notes: list, log=print):
    """DeepSpeed, joined to torchrun's gloo group, or None with the reason appended to `notes` and logged."""
    if args.no_deepspeed:
        notes.append("DeepSpeed skipped: --no-deepspeed")
    elif optional_import("deepspeed") is None:
        notes.append("DeepSpeed skipped: not installed (pip install 'zerotron[bench]')")
    else:
        import logging

        import deepspeed

        deepspeed.utils.logger.setLevel(logging.WARNING)
        deepspeed.init_distributed(dist_backend="gloo")  # adopts the gloo group torchrun's job already has
        return deepspeed
    log(notes[-1])
    return None


# ---- model and data ------------------------------------------------------------------------------
def gpt_config(args):
    from zerotron.models.gpt import GPTConfig

    return GPTConfig(
        n_layer=args.layers,
        n_head=args.heads,
        n_kv_head=args.heads,
        d_model=args.d_model,
        max_seq_len=args.seq,
        vocab_size=256,
    )


def build_gpt(cfg, seed: int = 0) -> torch.nn.Module:
    """The reference GPT with seeded (so identical on every rank and for every system) fp32 weights."""
    from zerotron.models.gpt import GPT

    torch.manual_seed(seed)
    return GPT(cfg)


def to_pipeline(model, stages: int, **kwargs):
    """The GPT as a zerotron PipelineModule of `stages` stages (kwargs: PipelineModule's, e.g. partition_method)."""
    from zerotron.parallelize import to_pipeline

    return to_pipeline(model, stages, **kwargs)


def batches_for(args, cfg, rank: int = 0, world: int = 1, rounds: int | None = None):
    """Enough batches for --warmup + rounds x --steps steps of every system."""
    n = args.warmup + (args.rounds if rounds is None else rounds) * args.steps
    return make_batches(n, args.batch, args.seq, cfg.vocab_size, rank, world)


def announce(log, args, cfg, what: str) -> None:
    """The run's one-line description: the model, `what` (layout, precision, ...), rounds, load."""
    log(
        f"GPT {args.layers} layers, d={args.d_model}, {args.heads} heads, {gpt_shape(cfg).parameters / 1e6:.2f}M "
        f"params, seq {args.seq}, {what}; {args.warmup} warm-up + {args.rounds} rounds x {args.steps} timed steps "
        f"per system; load average {os.getloadavg()[0]:.2f}"
    )


def model_json(args, cfg, **extra) -> dict:
    return {
        "layers": args.layers,
        "d_model": args.d_model,
        "heads": args.heads,
        "seq": args.seq,
        "params": gpt_shape(cfg).parameters,
        **extra,
    }


# ---- timing ---------------------------------------------------------------------------------------
def rotated(names: list, r: int) -> list:
    """`names` in round `r`'s order: each round starts one further along."""
    k = r % len(names)
    return names[k:] + names[:k]


def rounds(entries: list, run: Callable, n_rounds: int, steps: int, on_round=lambda r, round_ms: None, block: int = 1):
    """`n_rounds` rounds, each running every entry `steps` times in rotating order; `run(entry)` returns
    milliseconds. Returns ({entry: every ms}, {entry: median ms per round}); on_round(r, that) after each.
    `block`: the order rotates by that many entries a round, so blocks of consecutive entries (one
    system's modes) keep their inner order."""
    ms, round_ms = {e: [] for e in entries}, {e: [] for e in entries}
    for r in range(n_rounds):
        for e in rotated(list(entries), r * block):
            t = [run(e) for _ in range(steps)]
            ms[e] += t
            round_ms[e].append(statistics.median(t))
        on_round(r, round_ms)
    return ms, round_ms


def run_rounds(systems: dict[str, Callable], batches, warmup: int, steps: int, n_rounds: int, log=print):
    """Run every system `warmup` untimed steps, then `n_rounds` rounds of `steps` timed steps each.

    A system is `step(tokens, targets) -> float loss` and keeps its own state, so all systems see
    batch k at their k-th step. The order of systems rotates each round. Each step is bracketed by
    barriers, so its time is that of the slowest rank. Returns {name: {"ms": [...], "losses": [...],
    "round_ms": [median per round], "losses_mean_over_ranks", "median_ms"}}; "losses" holds every step's
    local loss, warm-up included.
    """
    names = list(systems)
    losses = {n: [] for n in names}

    def one_step(name):
        tokens, targets = batches[len(losses[name])]
        dist.barrier()
        t0 = time.perf_counter()
        loss = systems[name](tokens, targets)
        dist.barrier()
        ms = (time.perf_counter() - t0) * 1e3
        losses[name].append(float(loss))
        return ms

    for name in names:
        for _ in range(warmup):
            one_step(name)
    ms, round_ms = rounds(
        names,
        one_step,
        n_rounds,
        steps,
        lambda r, rm: log(f"round {r + 1}/{n_rounds}: " + ", ".join(f"{n} {rm[n][-1]:.1f} ms" for n in names)),
    )
    res = {}
    # One rank's clock is enough (the barriers line the ranks up); average anyway so rank 0 reports both.
    for name in names:
        mean = {}
        for key, values in (("ms", ms[name]), ("losses", losses[name])):
            t = torch.tensor(values, dtype=torch.float64)
            dist.all_reduce(t)
            mean[key] = (t / dist.get_world_size()).tolist()
        res[name] = {
            "ms": mean["ms"],
            "losses": losses[name],
            "round_ms": round_ms[name],
            "losses_mean_over_ranks": mean["losses"],
            "median_ms": statistics.median(mean["ms"]),
        }
    return res


def paired_ratio(res: dict, a: str, b: str) -> float:
    """Median over rounds of a's round median / b's: robust to load that drifts between rounds."""
    return statistics.median(x / y for x, y in zip(res[a]["round_ms"], res[b]["round_ms"]))


def max_loss_diff(a: list[float], b: list[float], start: int = 0) -> tuple[float, float]:
    """(max |a-b|, max |a-b|/|b|) over steps[start:]."""
    pairs = list(zip(a[start:], b[start:]))
    return (max(abs(x - y) for x, y in pairs), max(abs(x - y) / abs(y) for x, y in pairs))


def compare(res: dict, baseline: str, start: int = 0) -> dict[str, dict]:
    """{system: row}: median ms, step and round times, losses (mean over ranks) and the largest loss
    difference from `baseline`'s over steps[start:] (loss_diff absolute, loss_rel_diff relative)."""
    ref = res[baseline]["losses_mean_over_ranks"]
    rows = {}
    for name, r in res.items():
        diff, rel = max_loss_diff(r["losses_mean_over_ranks"], ref, start)
        rows[name] = {
            "system": name,
            "median_ms": r["median_ms"],
            "round_ms": r["round_ms"],
            "loss_diff": diff,
            "loss_rel_diff": rel,
            "losses": r["losses_mean_over_ranks"],
            "step_ms": r["ms"],
        }
    return rows


def pair(res: dict, a: str, b: str) -> dict:
    """a against b: the medians, their ratio, the paired ratio and the largest loss difference (every step)."""
    return {
        "median_zt_ms": res[a]["median_ms"],
        "median_torch_ms": res[b]["median_ms"],
        "ratio": res[a]["median_ms"] / res[b]["median_ms"],
        "paired": paired_ratio(res, a, b),
        "loss_diff": max_loss_diff(res[a]["losses_mean_over_ranks"], res[b]["losses_mean_over_ranks"])[0],
    }


def max_over_ranks(x: float) -> float:
    t = torch.tensor([float(x)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


# ---- memory ---------------------------------------------------------------------------------------
def local_tensor(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t  # DTensor: this rank's shard


def tensor_bytes(tensors, seen: set | None = None) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one buffer count once; storages in `seen`,
    which this extends, not at all)."""
    seen, total = set() if seen is None else seen, 0
    for t in tensors:
        if not torch.is_tensor(t):
            continue
        s = local_tensor(t).untyped_storage()
        if s.nbytes() and s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


def model_state_bytes(params, optimizer, extra: int = 0) -> dict[str, int]:
    """This rank's params, grads and optimizer-state bytes (plus `extra`, e.g. communication buckets)."""
    params = list(params)
    out = {
        "params": tensor_bytes(params),
        "grads": tensor_bytes(p.grad for p in params),
        "optimizer": tensor_bytes(v for s in optimizer.state.values() for v in s.values()),
        "buffers": extra,
    }
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
def print_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> None:
    print("\n".join(table_lines(rows, columns)))


def finish(name: str, args, payload: dict, rank: int = 0) -> None:
    """Rank 0 writes {benchmark, args, environment, **payload} to --out (default bench/results/<name>.json)
    and says where; then every rank leaves the process group."""
    if rank == 0:
        path = write_json(
            name, {"benchmark": name, "args": json_args(args), "environment": environment(), **payload}, args.out
        )
        print(f"\nwrote {path}")
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
