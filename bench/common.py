"""The benchmark harness: launch, model and data, rounds, comparison, memory, FLOPs, reporting, time limits.

A side-by-side benchmark runs all of its systems in ONE torchrun job on the same seeded model, data and
process count, alternating them in rounds so that a noisy machine slows them all alike. A script only
describes its systems (each a `step(tokens, targets) -> float loss` keeping its own state):

    args = common.base_parser(__doc__.splitlines()[0]).parse_args()
    rank, world, log, cfg = common.start(args)        # re-executes itself under torchrun, joins gloo
    engine, systems["zt"] = common.zerotron_step(common.build_gpt(cfg), args.batch // world, clip=0.0)
    systems["ddp"] = common.torch_step(DDP(common.build_gpt(cfg)), opt)
    res = common.run_rounds(systems, common.batches_for(args, cfg, rank, world), args.warmup, args.steps,
                            args.rounds, log)         # warm-up, then rounds in rotating order, between barriers
    rows = common.compare(res, "ddp", start=args.warmup)   # medians and max |loss difference| vs a baseline
    if rank == 0: common.print_table(list(rows.values()), [("system", "system", "{}"), ...])
    common.finish("dp", args, {"results": ...}, rank)  # rank 0 writes bench/results/dp.json; leaves the job

Launch: base_parser, names_arg, start (relaunch_under_torchrun, init_gloo), child_env, torchrun_cmd; time
limits: spawn / wait_limited / run_limited (past the limit the child's whole process group is killed).
Systems: ADAMW, zerotron_config, zerotron_step, engine_step, torch_step, load_deepspeed. Model and data:
gpt_config, build_gpt, to_pipeline, make_batches, batches_for. FLOPs: gpt_shape, flops_per_token (the planner's
6N + 12·L·d·s), peak_flops (the planner's hardware table). Rounds: rounds (any entries), run_rounds (ranks).
Results: compare, pair, paired_ratio, max_loss_diff, max_over_ranks. Memory: tensor_bytes, model_state_bytes,
measure_after_first_step. Reporting: announce, model_json, environment, table_lines / print_table,
write_json, finish.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
import traceback
import weakref
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
LOADAVG_START = os.getloadavg()[0]
ADAMW = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}  # every system, every benchmark
# What torchrun (and torch.distributed.elastic) set for its workers: a child that starts a world of its own
# must not inherit them.
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR",
               "MASTER_PORT", "TORCHELASTIC_RUN_ID")

_SYNCS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.__bool__,
          torch.Tensor.__int__, torch.Tensor.__float__}


_FACTORIES = {torch.zeros, torch.ones, torch.empty, torch.full, torch.arange, torch.zeros_like, torch.ones_like,
              torch.empty_like, torch.full_like, torch.stack, torch.cat}
_FROM_DATA = {torch.tensor, torch.as_tensor}
_MOVES = {torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.copy_}


class SyncCounter(TorchFunctionMode):
    """Counts the calls that make the host wait for the device, each with the zerotron line it came
    from: on a CPU, where nothing has to wait, this is how a test sees the syncs a GPU would pay for.
    - reads of device values (.item(), .tolist(), bool(t), ...);
    - copies to the device from pageable host memory, which drain the stream before they start:
      `torch.tensor(data, device=...)` (Python data goes through a host tensor), and a tensor made on
      the host (a factory without a device, or what is computed from one) moved or copied to a
      device. Host buffers made on purpose (zerotron.comm.host_buffer: offload, staging) are
      page-locked on a GPU and do not count; nor does pinned memory."""

    def __init__(self):
        super().__init__()
        self.where = []
        self._host_born: set[int] = set()  # ids of live tensors made on the host (not a WeakSet: tensors compare elementwise)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _SYNCS or self._pageable_upload(func, args, kwargs):
            frame = next((f for f in reversed(traceback.extract_stack()[:-1]) if "/zerotron/" in f.filename), None)
            self.where.append(f"{func.__name__} at {frame.filename.rsplit('/zerotron/', 1)[-1]}:{frame.lineno}"
                              if frame else func.__name__)
        out = func(*args, **kwargs)
        if torch.is_tensor(out) and id(out) not in self._host_born and self._made_on_host(func, args, kwargs):
            self._host_born.add(id(out))
            weakref.finalize(out, self._host_born.discard, id(out))
        return out

    def _on_host(self, t) -> bool:
        return id(t) in self._host_born

    def _made_on_host(self, func, args, kwargs) -> bool:
        if func in _FACTORIES or func in _FROM_DATA:
            return kwargs.get("device") is None and not (func in _FACTORIES and any(
                not self._on_host(a) for a in _tensors(args)))
        return func not in _MOVES and any(self._on_host(a) for a in _tensors(args))

    def _pageable_upload(self, func, args, kwargs) -> bool:
        if func in _FROM_DATA:
            return kwargs.get("device") is not None and not torch.is_tensor(args[0] if args else None)
        if func not in _MOVES or not args:
            return False
        from zerotron.comm import HostTensor
        source = args[1] if func is torch.Tensor.copy_ else args[0]
        if not torch.is_tensor(source) or not self._on_host(source) or isinstance(source, HostTensor) \
                or source.is_pinned():
            return False
        if func is torch.Tensor.copy_:
            return not self._on_host(args[0])
        return func is torch.Tensor.cuda or kwargs.get("device") is not None or any(
            isinstance(a, (torch.device, str)) for a in args[1:])


def _tensors(args):
    for a in args:
        if torch.is_tensor(a):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from (t for t in a if torch.is_tensor(t))


# ---- launch and time limits -----------------------------------------------------------------------
def child_env(**extra) -> dict:
    """This process's environment without torchrun's variables, plus `extra` (values made strings)."""
    return {**{k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}, **{k: str(v) for k, v in extra.items()}}


def torchrun_cmd(nproc: int, script, *args) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(script),
            *map(str, args)]


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


# ---- systems --------------------------------------------------------------------------------------
def zerotron_config(per_rank: int, clip: float = 0.0, stage: int = 0, adamw: dict | None = ADAMW, gas: int = 1,
                    **sections) -> dict:
    """A DeepSpeed config: `per_rank` sequences per micro-step, `gas` micro-steps, ZeRO `stage`, gradient
    clipping `clip` (set explicitly: DeepSpeed's default is 1.0), AdamW `adamw` (None: a client optimizer);
    `sections` add or replace top-level sections."""
    config = {"train_micro_batch_size_per_gpu": per_rank, "gradient_accumulation_steps": gas,
              "steps_per_print": 10**9, "zero_optimization": {"stage": stage}, "gradient_clipping": clip}
    if adamw is not None:
        config["optimizer"] = {"type": "AdamW", "params": {**adamw, "betas": list(adamw["betas"])}}
    return {**config, **sections}


def phase(name: str, on: bool = True):
    """A profiler range around one phase of a step (forward, backward, step), or nothing when not `on`."""
    return torch.profiler.record_function(f"phase:{name}") if on else contextlib.nullcontext()


def engine_step(engine, phases: bool = False) -> Callable:
    """The one-step function of a DeepSpeed-style engine (zerotron's or DeepSpeed's)."""
    def step(tokens, targets):
        with phase("forward", phases):
            loss = engine(tokens, targets)
        with phase("backward", phases):
            engine.backward(loss)
        with phase("step", phases):
            engine.step()
        return loss.item()
    return step


def zerotron_step(model, per_rank: int, clip: float, adamw: dict = ADAMW, phases: bool = False, **config):
    """A zerotron engine on `model` (AdamW as every system) and its one-step function; `config` adds or
    overrides sections of the DeepSpeed config (zerotron_config's keywords)."""
    import zerotron
    engine, *_ = zerotron.initialize(model=model, config=zerotron_config(per_rank, clip, adamw=adamw, **config))
    return engine, engine_step(engine, phases)


def torch_step(model, opt, clip: float = 0.0, phases: bool = False, autocast=None, foreach=None) -> Callable:
    """Plain torch: forward (under `autocast()` if given), backward, clip_grad_norm_ to `clip` (0: off),
    opt.step(), opt.zero_grad()."""
    autocast = autocast or contextlib.nullcontext

    def step(tokens, targets):
        with phase("forward", phases), autocast():
            loss = model(tokens, targets)
        with phase("backward", phases):
            loss.backward()
        with phase("step", phases):
            if clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip, foreach=foreach)
            opt.step()
            opt.zero_grad()
        return loss.item()
    return step


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


# ---- model, data and FLOPs ------------------------------------------------------------------------
def gpt_config(args):
    from zerotron.models.gpt import GPTConfig
    return GPTConfig(n_layer=args.layers, n_head=args.heads, n_kv_head=args.heads, d_model=args.d_model,
                     max_seq_len=args.seq, vocab_size=256)


def build_gpt(cfg, seed: int = 0) -> torch.nn.Module:
    """The reference GPT with seeded (so identical on every rank and for every system) fp32 weights."""
    from zerotron.models.gpt import GPT
    torch.manual_seed(seed)
    return GPT(cfg)


def to_pipeline(model, stages: int, **kwargs):
    """The GPT as a zerotron PipelineModule of `stages` stages (kwargs: PipelineModule's, e.g. partition_method)."""
    from zerotron.parallelize import to_pipeline
    return to_pipeline(model, stages, **kwargs)


def gpt_shape(cfg):
    """The planner's view of a GPT config: its parameter count and FLOPs without building it."""
    from zerotron.planner.model import ModelShape
    return ModelShape.of_gpt(cfg)


def flops_per_token(cfg, seq: int) -> float:
    """6N + 12·L·d·s, N without the embedding (a lookup, not a matmul): the planner's and GPT.flops_per_token."""
    return gpt_shape(cfg).flops_per_token(seq)


def peak_flops(device_name: str) -> float | None:
    """Dense bf16 peak FLOP/s of a GPU, by its name, from the planner's hardware table (None: not in it)."""
    from zerotron.planner.hardware import PRESETS
    name = device_name.lower()
    return next((hw.peak_flops for key, hw in PRESETS.items() if key != "cpu" and key.split("-")[0] in name), None)


def make_batches(n: int, batch: int, seq: int, vocab: int, rank: int = 0, world: int = 1, seed: int = 1234,
                 device=None):
    """`n` steps of (tokens, targets) of random bytes: this rank's contiguous slice of each global batch of
    `batch` sequences (a world of one: all of it), made on `device`."""
    if batch % world:
        raise SystemExit(f"--batch {batch} must be divisible by the {world} ranks")
    g = torch.Generator(device=device or "cpu").manual_seed(seed)
    data = torch.randint(0, vocab, (n, batch, seq + 1), generator=g, device=device)
    per = batch // world
    return [(d[:, :-1].contiguous(), d[:, 1:].contiguous()) for d in data[:, rank * per:(rank + 1) * per]]


def batches_for(args, cfg, rank: int = 0, world: int = 1, rounds: int | None = None):
    """Enough batches for --warmup + rounds x --steps steps of every system."""
    n = args.warmup + (args.rounds if rounds is None else rounds) * args.steps
    return make_batches(n, args.batch, args.seq, cfg.vocab_size, rank, world)


def announce(log, args, cfg, what: str) -> None:
    """The run's one-line description: the model, `what` (layout, precision, ...), rounds, load."""
    log(f"GPT {args.layers} layers, d={args.d_model}, {args.heads} heads, {gpt_shape(cfg).parameters / 1e6:.2f}M "
        f"params, seq {args.seq}, {what}; {args.warmup} warm-up + {args.rounds} rounds x {args.steps} timed steps "
        f"per system; load average {os.getloadavg()[0]:.2f}")


def model_json(args, cfg, **extra) -> dict:
    return {"layers": args.layers, "d_model": args.d_model, "heads": args.heads, "seq": args.seq,
            "params": gpt_shape(cfg).parameters, **extra}


# ---- timing ---------------------------------------------------------------------------------------
def rotated(names: list, r: int) -> list:
    """`names` in round `r`'s order: each round starts one further along."""
    k = r % len(names)
    return names[k:] + names[:k]


def rounds(entries: list, run: Callable, n_rounds: int, steps: int, on_round=lambda r, round_ms: None,
           block: int = 1):
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
    ms, round_ms = rounds(names, one_step, n_rounds, steps, lambda r, rm: log(
        f"round {r + 1}/{n_rounds}: " + ", ".join(f"{n} {rm[n][-1]:.1f} ms" for n in names)))
    res = {}
    # One rank's clock is enough (the barriers line the ranks up); average anyway so rank 0 reports both.
    for name in names:
        mean = {}
        for key, values in (("ms", ms[name]), ("losses", losses[name])):
            t = torch.tensor(values, dtype=torch.float64)
            dist.all_reduce(t)
            mean[key] = (t / dist.get_world_size()).tolist()
        res[name] = {"ms": mean["ms"], "losses": losses[name], "round_ms": round_ms[name],
                     "losses_mean_over_ranks": mean["losses"], "median_ms": statistics.median(mean["ms"])}
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
        rows[name] = {"system": name, "median_ms": r["median_ms"], "round_ms": r["round_ms"], "loss_diff": diff,
                      "loss_rel_diff": rel, "losses": r["losses_mean_over_ranks"], "step_ms": r["ms"]}
    return rows


def pair(res: dict, a: str, b: str) -> dict:
    """a against b: the medians, their ratio, the paired ratio and the largest loss difference (every step)."""
    return {"median_zt_ms": res[a]["median_ms"], "median_torch_ms": res[b]["median_ms"],
            "ratio": res[a]["median_ms"] / res[b]["median_ms"], "paired": paired_ratio(res, a, b),
            "loss_diff": max_loss_diff(res[a]["losses_mean_over_ranks"], res[b]["losses_mean_over_ranks"])[0]}


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
    return {"torch": torch.__version__, **versions, "python": platform.python_version(), "cpu_cores": os.cpu_count(),
            "omp_threads": torch.get_num_threads(), **group,
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "machine": platform.machine(), "platform": platform.platform(), **zerotron_source(),
            "loadavg_start": LOADAVG_START, "loadavg_end": os.getloadavg()[0], **extra}


def table_lines(rows: list[dict], columns: list[tuple[str, str, str]], missing: str = "", rule: bool = True,
                indent: str = "") -> list[str]:
    """rows: dicts; columns: (key, header, format) e.g. ("median_ms", "median ms", "{:.1f}"); a value that is
    None or absent shows as `missing`. The first column is left-aligned, the others right-aligned."""
    cells = [[h for _, h, _ in columns]] + [
        [missing if r.get(k) is None else f.format(r[k]) for k, _, f in columns] for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    lines = [indent + "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths)))
             for line in cells]
    return lines[:1] + [indent + "  ".join("-" * w for w in widths)] * rule + lines[1:]


def print_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> None:
    print("\n".join(table_lines(rows, columns)))


def json_args(args) -> dict:
    return {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}


def write_json(name: str, payload: dict, path: Path | None = None) -> Path:
    path = Path(path or RESULTS / f"{name}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    return path


def finish(name: str, args, payload: dict, rank: int = 0) -> None:
    """Rank 0 writes {benchmark, args, environment, **payload} to --out (default bench/results/<name>.json)
    and says where; then every rank leaves the process group."""
    if rank == 0:
        path = write_json(name, {"benchmark": name, "args": json_args(args), "environment": environment(),
                                 **payload}, args.out)
        print(f"\nwrote {path}")
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
