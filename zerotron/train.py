"""The reference job behind `zerotron train`: the reference GPT on the embedded corpus."""

from __future__ import annotations

import argparse
import math
import os
import time

import torch
import torch.distributed as dist

from . import preemption
from .comm import comm_for
from .config import CHECKPOINT_POLICIES, SCHEDULES
from .errors import EXIT_PREEMPTED
from .parallelize import to_pipeline
from .planner.hardware import peak_flops_of


def add_train_arguments(p: argparse.ArgumentParser):
    p.add_argument(
        "--model", default="small", help="reference GPT size: tiny, small, ... 13b; mixtures of experts: moe-tiny, ..."
    )
    p.add_argument("--steps", type=int, default=300, help="optimizer steps")
    p.add_argument("--nproc", type=int, default=None, help="processes (default: all GPUs, else 2 CPU processes)")
    p.add_argument("--config", default=None, help="DeepSpeed JSON config; the flags below override it")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=None, help="sequences per process per micro-step (default 8)")
    p.add_argument("--grad-accum", type=int, default=None, help="micro-steps per optimizer step (default 1)")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default 3e-3)")
    p.add_argument(
        "--precision", choices=["fp32", "bf16", "fp16"], default=None, help="default: bf16 on GPUs, fp32 on CPUs"
    )
    p.add_argument("--zero", type=int, default=None, help="ZeRO stage")
    p.add_argument("--dp", type=int, default=None, help="data-parallel size (default: processes / (tp x pp))")
    p.add_argument("--tp", type=int, default=None, help="tensor-parallel size")
    p.add_argument(
        "--sp", type=int, default=None, help="Ulysses sequence-parallel size: each sequence split over this many ranks"
    )
    p.add_argument(
        "--cp", type=int, default=None, help="ring attention (context parallelism): each sequence over this many ranks"
    )
    p.add_argument("--pp", type=int, default=None, help="pipeline-parallel stages")
    p.add_argument("--ep", type=int, default=None, help="expert-parallel size: a moe-* model's experts split over it")
    p.add_argument(
        "--schedule",
        choices=list(SCHEDULES),
        default=None,
        help="pipeline schedule (default 1f1b; interleaved with --virtual-stages; zb-h1: zero bubble)",
    )
    p.add_argument("--virtual-stages", type=int, default=1, help="model chunks per pipeline stage (interleaved 1F1B)")
    p.add_argument(
        "--sequence-parallel",
        action="store_true",
        default=None,
        help="split norms/residuals along the sequence (with --tp)",
    )
    p.add_argument(
        "--tp-overlap",
        action="store_true",
        default=None,
        help="run each block in two halves of the micro-batch, one half's tensor-parallel collective "
        "under the other's compute (tensor_parallel.tp_overlap_comm; with --tp)",
    )
    p.add_argument("--checkpoint", choices=CHECKPOINT_POLICIES, default=None, help="activation checkpointing policy")
    p.add_argument("--save-dir", default=None, help="write checkpoints here (every --save-every steps and at the end)")
    p.add_argument("--save-every", type=int, default=0, help="checkpoint period in steps (0: only at the end)")
    p.add_argument(
        "--resume",
        nargs="?",
        const="auto",
        choices=["auto"],
        default=None,
        help="continue from the newest complete checkpoint in --save-dir, if there is one ('auto')",
    )
    p.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="restart every process this many times when one fails (with --resume: from the newest checkpoint)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-batches", type=int, default=8, help="validation micro-batches per process")
    p.add_argument("--sample-bytes", type=int, default=200, help="length of the generated sample (0: none)")
    p.add_argument("--corpus-bytes", type=int, default=None, help="cap on the training corpus size")


def build_config(args, gpu: bool) -> dict:
    """The DeepSpeed config of the job: --config if given, else defaults; explicit flags override."""
    from .config import read_raw

    cfg = (
        read_raw(args.config)
        if args.config
        else {
            "train_micro_batch_size_per_gpu": 8,
            "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "weight_decay": 0.1}},
            "scheduler": {
                "type": "WarmupCosineLR",
                "params": {
                    "total_num_steps": args.steps,
                    "warmup_num_steps": max(1, args.steps // 20),
                    "warmup_type": "linear",
                    "cos_min_ratio": 0.1,
                },
            },
            "steps_per_print": 10**9,  # the progress bar reports instead
        }
    )
    if args.micro_batch is not None:
        cfg["train_micro_batch_size_per_gpu"] = args.micro_batch
        cfg.pop("train_batch_size", None)
    if args.grad_accum is not None:
        cfg["gradient_accumulation_steps"] = args.grad_accum
        cfg.pop("train_batch_size", None)
    if args.lr is not None:
        cfg.setdefault("optimizer", {"type": "AdamW", "params": {}}).setdefault("params", {})["lr"] = args.lr
    precision = args.precision or (None if args.config else ("bf16" if gpu else "fp32"))
    if precision is not None:
        cfg["bf16"] = {"enabled": precision == "bf16"}
        cfg["fp16"] = {**cfg.get("fp16", {}), "enabled": precision == "fp16"}
    if args.zero is not None:
        cfg.setdefault("zero_optimization", {})["stage"] = args.zero
    if args.tp is not None:
        cfg.setdefault("tensor_parallel", {})["autotp_size"] = args.tp
    if args.sp is not None:
        cfg["sequence_parallel_size"] = args.sp
    if args.cp is not None:
        cfg.setdefault("zerotron", {})["context_parallel_size"] = args.cp
    if args.sequence_parallel:
        cfg.setdefault("zerotron", {})["sequence_parallel"] = True
    if args.tp_overlap:
        cfg.setdefault("tensor_parallel", {})["tp_overlap_comm"] = True
    if args.checkpoint is not None:
        cfg.setdefault("zerotron", {})["checkpoint_policy"] = args.checkpoint
    if args.pp is not None:
        cfg.setdefault("pipeline", {})["stages"] = args.pp
    if args.ep is not None:
        cfg["expert_parallel"] = {"enabled": args.ep > 1, "autoep_size": args.ep}
    if args.schedule is not None or args.virtual_stages > 1:
        cfg.setdefault("pipeline", {})["schedule"] = args.schedule or "interleaved"
    return cfg


def adopt_config_layout(args) -> None:
    """A --config may carry the layout (`zerotron plan` writes one): tensor and pipeline sizes come
    from it unless --tp / --pp give them, so the model is built (and split) to match."""
    if not args.config:
        return
    from .config import read_raw

    raw = read_raw(args.config)
    tp, stages = raw.get("tensor_parallel", {}).get("autotp_size"), raw.get("pipeline", {}).get("stages")
    if args.tp is None and isinstance(tp, int):
        args.tp = tp
    if args.sp is None and isinstance(raw.get("sequence_parallel_size"), int):
        args.sp = raw["sequence_parallel_size"]
    if args.cp is None and isinstance(raw.get("zerotron", {}).get("context_parallel_size"), int):
        args.cp = raw["zerotron"]["context_parallel_size"]
    if args.pp is None and isinstance(stages, int):
        args.pp = stages


def world_size_of(args, default: int) -> int:
    """Processes for the job: --dp x --cp x --sp x --tp x --pp when --dp is given, else --nproc (or
    `default`, raised to the model- and sequence-parallel size when that does not divide it)."""
    model_parallel = (args.tp or 1) * (args.pp or 1) * (args.sp or 1) * (args.cp or 1)
    if args.dp is not None:
        if args.dp < 1:
            raise SystemExit("--dp must be a positive integer")
        world = args.dp * model_parallel
        if args.nproc is not None and args.nproc != world:
            raise SystemExit(
                f"--nproc {args.nproc} disagrees with --dp x --cp x --sp x --tp x --pp = {world}; give one of them"
            )
        return world
    world = args.nproc or default
    return world if args.nproc or world % model_parallel == 0 else model_parallel


def check_model_layout(args) -> None:
    """The reference GPT's own limit on the layout, named before any process starts: every pipeline
    stage (and model chunk) needs at least one of its layers."""
    from .models.gpt import SIZES

    if args.model not in SIZES:
        raise SystemExit(f"--model {args.model}: not a reference GPT size; choose one of {', '.join(SIZES)}")
    multiple = (args.sp or 1) * (2 * args.cp if (args.cp or 1) > 1 else 1)
    if args.seq_len % multiple:
        asked = " x ".join(f"--{k} {v}" for k, v in (("cp", args.cp), ("sp", args.sp)) if v and v > 1)
        raise SystemExit(
            f"{asked}: each sequence is split into {multiple} equal pieces (the ring's head and tail halves x "
            f"Ulysses' slices), and --seq-len {args.seq_len} is not a multiple of it; use --seq-len "
            f"{args.seq_len - args.seq_len % multiple or multiple}"
        )
    layers, chunks = SIZES[args.model].n_layer, (args.pp or 1) * args.virtual_stages
    if chunks > layers:
        asked = f"--pp {args.pp or 1}" + (
            f" x --virtual-stages {args.virtual_stages}" if args.virtual_stages > 1 else ""
        )
        raise SystemExit(
            f"{asked}: the {args.model} GPT has {layers} layers and each pipeline stage needs at least "
            f"one; use at most {layers} stages in all, or a larger --model"
        )


def _peak_flops() -> float | None:
    if not torch.cuda.is_available():
        return None
    return peak_flops_of(torch.cuda.get_device_name())


def _sequence_slices(engine, batches):
    """Each sequence rank trains on its part of every sequence (all of it without sequence
    parallelism; long_context/layout.py)."""
    from .long_context.layout import SequenceSplit

    split = SequenceSplit.of(engine.topology, torch.distributed.get_rank() if engine.topology.seq > 1 else 0)
    for x, y in batches:
        yield split.take(x), split.take(y)


def _expert_dim(topology) -> str:
    return f" (experts over ep {topology.ep})" if topology.ep > 1 else ""


def _sequence_dims(topology) -> str:
    return "".join(f" x {d} {getattr(topology, d)}" for d in ("cp", "sp") if getattr(topology, d) > 1)


@torch.no_grad()
def _validation_loss(engine, val, batches: int, micro_batch: int) -> float:
    """Mean loss over `batches` full micro-batches of each data-parallel rank's share (all equal
    in size, so the mean of their means is the mean over sequences)."""
    dp, rank = engine.topology.dp, engine.coords.dp
    batches = max(1, min(batches, len(val) // (micro_batch * dp)))
    idx = list(range(rank, batches * micro_batch * dp, dp))
    micro = []
    for i in range(0, len(idx), micro_batch):
        xs, ys = zip(*(val[j] for j in idx[i : i + micro_batch]))
        micro.append((torch.stack(xs), torch.stack(ys)))
    return engine.eval_batch(_sequence_slices(engine, micro), num_micro_batches=len(micro)).item()


def train(args) -> None:
    from tqdm import tqdm

    import zerotron

    from .data import corpus_loaders
    from .models.gpt import GPT, config_for

    zerotron.init_distributed()
    adopt_config_layout(args)
    gpu = torch.cuda.is_available()
    torch.manual_seed(args.seed)
    model = GPT(config_for(args.model, max_seq_len=args.seq_len))
    # Counted whole, before tensor parallelism splits the model (a rank's shard is 1/tp of it).
    n_params, flops_per_token = model.num_params(), model.flops_per_token(args.seq_len)
    pipelined = (args.pp or 1) > 1
    module = (
        to_pipeline(model, args.pp, partition_method="type:_PipeBlock", num_virtual_stages=args.virtual_stages)
        if pipelined
        else model
    )
    engine, *_ = zerotron.initialize(model=module, config=build_config(args, gpu))
    rank0 = engine.global_rank == 0
    mb, seq = engine.train_micro_batch_size_per_gpu(), args.seq_len
    loader, val = corpus_loaders(
        seq,
        mb,
        engine.topology.dp,
        engine.coords.dp,
        seed=args.seed,
        max_bytes=args.corpus_bytes,
        global_batch=engine.train_batch_size(),
    )
    say = print if rank0 else (lambda *a, **k: None)
    if args.resume and not args.save_dir:
        raise SystemExit("--resume needs --save-dir (where the checkpoints are)")
    if args.save_dir:  # SIGTERM/SIGINT: finish the step, checkpoint, exit EXIT_PREEMPTED
        preemption.install()
    first_step = 0
    if args.resume:
        path, client = engine.load_checkpoint(args.save_dir)
        if path is None:
            yet = "" if os.path.isdir(args.save_dir) else " (the directory does not exist yet)"
            say(f"--resume: no checkpoint in {args.save_dir}{yet}; starting from scratch")
        else:  # the same data order: the sampler continues where the saved run was
            loader.sampler.load_state_dict(client["sampler"])
            first_step = engine.global_steps
            say(f"resumed from {path} at step {first_step}")
    # A DataLoader iterator draws a base seed from the global RNG (unused with num_workers=0); put
    # the state back so a resumed run's random stream (dropout) matches an uninterrupted one's.
    rng = torch.get_rng_state()
    data = _sequence_slices(engine, iter(loader))
    torch.set_rng_state(rng)
    say(
        f"zerotron train: {args.model} GPT, {n_params / 1e6:.2f}M parameters, "
        f"{engine.world_size} x {engine.device.type} ({dist.get_backend()}), "
        f"dp {engine.topology.dp}{_expert_dim(engine.topology)}{_sequence_dims(engine.topology)} x tp "
        f"{engine.topology.tp} x pp {engine.topology.pp}, "
        f"{engine.config.model_dtype_name}, "
        f"batch {engine.train_batch_size()} x {seq} tokens, {args.steps} steps"
    )
    val_before = _validation_loss(engine, val, args.eval_batches, mb)

    tokens_per_step = engine.train_batch_size() * seq
    peak = _peak_flops()
    bar = tqdm(total=args.steps, initial=first_step, disable=not rank0, unit="step", dynamic_ncols=True)
    start = time.perf_counter()
    for step in range(first_step, args.steps):
        t0 = time.perf_counter()
        loss = engine.train_batch(data)  # NaN/Inf steps are skipped there; a streak of them stops the job
        dt = time.perf_counter() - t0
        stats = {"loss": f"{loss.item():.3f}", "tok/s": f"{tokens_per_step / dt:,.0f}"}
        if peak:
            stats["MFU"] = f"{flops_per_token * tokens_per_step / dt / engine.world_size / peak:.1%}"
        bar.set_postfix(stats, refresh=False)
        bar.update(1)
        last = step + 1 == args.steps
        if args.save_dir and (
            last or engine.preemption_requested or (args.save_every and (step + 1) % args.save_every == 0)
        ):
            engine.save_checkpoint(args.save_dir, client_state={"sampler": loader.sampler.state_dict()})
        if engine.preemption_requested:
            bar.close()
            say(
                f"preempted: checkpoint saved at step {step + 1} in {args.save_dir}; exiting {EXIT_PREEMPTED} "
                "(run again with --resume to continue)"
            )
            raise SystemExit(EXIT_PREEMPTED)
    bar.close()
    elapsed = time.perf_counter() - start

    val_after = _validation_loss(engine, val, args.eval_batches, mb)
    done = args.steps - first_step
    say(
        f"trained {done} steps in {elapsed:.1f}s ({done * tokens_per_step / max(elapsed, 1e-9):,.0f} tokens/s); "
        f"validation loss {val_before:.3f} -> {val_after:.3f} (uniform guess: ln 256 = {math.log(256):.3f})"
    )
    if args.sample_bytes > 0 and (pipelined or engine.topology.seq > 1):
        say("sample: skipped (generation through pipeline stages or sequence slices is not implemented)")
    elif args.sample_bytes > 0:
        # Every rank generates (the same text, same seed): under ZeRO-3 each forward gathers
        # parameters with collectives that all ranks must join.
        prompt = torch.tensor([list(b"def ")], device=engine.device)
        g = torch.Generator(device=engine.device).manual_seed(args.seed)
        engine.module.eval()
        out = engine.module.generate(prompt, args.sample_bytes, temperature=0.8, top_k=40, generator=g)
        say("sample:\n" + bytes(out[0].tolist()).decode("utf-8", errors="replace"))
    comm_for(None, "world").barrier()
    dist.destroy_process_group()
