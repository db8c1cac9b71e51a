"""`zerotron estimate` (memory per GPU for each ZeRO stage) and `zerotron plan` (search, rank,
write the best config)."""

from __future__ import annotations

import json
from pathlib import Path

from .hardware import PRESETS, hardware
from .layout import EXPERT_IMBALANCE

HARDWARE_FIELDS = ("memory_gib", "peak_tflops", "intra_gbps", "inter_gbps", "host_gib", "efficiency", "pcie_gbps")


def _model_argument(p, default: str):
    p.add_argument(
        "--model",
        default=default,
        help="a zerotron size (1.3b, moe-small), an architecture (llama3-8b, mixtral-8x7b), a config.json "
        "path, or layers=..,hidden=..,heads=..,vocab=..[,experts=..,top_k=..,expert_ffn=..]",
    )


def add_estimate_arguments(p):
    _model_argument(p, "1.3b")
    p.add_argument("--dp", type=int, default=8)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size: a mixture's experts split over it")
    p.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="bf16")
    p.add_argument("--offload-optimizer", action="store_true")
    p.add_argument("--offload-param", action="store_true")
    p.add_argument("--persistence-threshold", type=int, default=100_000)
    p.add_argument("--seq", type=int, default=None, help="with --micro-batch: add the activations of one micro-batch")
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--checkpoint", choices=["none", "every_block", "selective"], default="none")
    p.add_argument("--sequence-parallel", action="store_true")


def add_plan_arguments(p):
    _model_argument(p, "llama3-8b")
    p.add_argument("--gpus", type=int, required=True, help="GPUs in the job")
    p.add_argument("--gpus-per-node", type=int, default=None, help="default: the hardware's (8)")
    p.add_argument("--hardware", default="h100", choices=sorted(PRESETS))
    for name in HARDWARE_FIELDS:
        p.add_argument("--" + name.replace("_", "-"), type=float, default=None, help="override the preset's " + name)
    p.add_argument("--seq", type=int, default=4096, help="sequence length")
    p.add_argument("--global-batch", type=int, required=True, help="sequences per optimizer step")
    p.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="bf16")
    p.add_argument("--max-micro-batch", type=int, default=16)
    p.add_argument("--zero", type=int, nargs="*", default=[0, 1, 2, 3], help="ZeRO stages to consider")
    p.add_argument("--no-offload", action="store_true", help="do not consider CPU offload")
    p.add_argument(
        "--sequence-splits",
        choices=["auto", "always", "never"],
        default="auto",
        help="each sequence over Ulysses x ring ranks (sequence_parallel_size, context_parallel_size): auto "
        "considers it when no layout fits without recomputation or offload",
    )
    p.add_argument(
        "--expert-imbalance",
        type=float,
        default=EXPERT_IMBALANCE,
        help="a mixture of experts: the busiest expert-parallel rank's routed rows over the mean",
    )
    p.add_argument("--top", type=int, default=10)
    p.add_argument("--out", default="plan.json", help="where to write the best layout's DeepSpeed config")
    p.add_argument("--plot", default=None, metavar="PNG", help="draw the top layouts' memory breakdown here")


def estimate(args) -> int:
    from .activations import activation_bytes
    from .memory import estimate_table
    from .model import ModelShape

    shape = ModelShape.parse(args.model)
    print(
        estimate_table(
            shape,
            args.dp,
            args.tp,
            args.pp,
            args.precision,
            args.offload_optimizer,
            args.offload_param,
            args.persistence_threshold,
            args.ep,
        )
    )
    if args.seq:
        act = activation_bytes(
            shape,
            args.micro_batch,
            args.seq,
            args.checkpoint,
            dtype=args.precision,
            tp=args.tp,
            sp=args.sequence_parallel,
            partition_activations=args.checkpoint != "none" and args.tp > 1,
            layers=-(-shape.layers // args.pp),
            ep=args.ep,
            imbalance=EXPERT_IMBALANCE,
        )
        print(
            f"activations of one micro-batch ({args.micro_batch} x {args.seq} tokens, checkpointing "
            f"{args.checkpoint}): {act / 2**30:.2f} GiB per GPU"
            + (
                f" (the busiest expert-parallel rank: {EXPERT_IMBALANCE:g} x the mean routed rows)"
                if args.ep > 1
                else ""
            )
        )
    return 0


def plan_command(args) -> int:
    from .model import ModelShape
    from .report import plot, pyplot, table
    from .search import deepspeed_config, plan

    if args.plot:
        pyplot()  # matplotlib is there, before the search and the config it writes
    shape = ModelShape.parse(args.model)
    overrides = {k: getattr(args, k) for k in HARDWARE_FIELDS}
    hw = hardware(args.hardware, **overrides, gpus_per_node=args.gpus_per_node)
    candidates = plan(
        shape,
        args.gpus,
        hw,
        args.seq,
        args.global_batch,
        args.precision,
        max_micro_batch=args.max_micro_batch,
        zero_stages=tuple(args.zero),
        offload=not args.no_offload,
        sequence_splits=args.sequence_splits,
        expert_imbalance=args.expert_imbalance,
    )
    experts = (
        f" ({shape.active_parameters / 1e9:.2f}B active: {shape.top_k} of {shape.experts} experts)"
        if shape.experts
        else ""
    )
    print(
        f"{args.model}: {shape.parameters / 1e9:.2f}B parameters{experts}, {args.gpus} x {hw.name}, seq {args.seq}, "
        f"global batch {args.global_batch} sequences, {args.precision}"
    )
    print(table(candidates, hw, args.top))
    best = candidates[0]
    if best.rejected is not None:
        print("\nnothing fits: add GPUs, shorten the sequence, or allow offload / more ZeRO stages")
        return 3
    config = deepspeed_config(best.layout, args.global_batch, args.precision)
    Path(args.out).write_text(json.dumps(config, indent=2) + "\n")
    from ..models.gpt import SIZES

    extra = f" --virtual-stages {best.layout.chunks}" if best.layout.chunks > 1 else ""
    if args.model in SIZES:
        how = f"zerotron train --model {args.model} --seq-len {args.seq} --config {args.out} --nproc {args.gpus}{extra}"
    else:
        how = f"zerotron.initialize(config='{args.out}') in your script ({args.gpus} processes: zerotron run)"
    print(f"\nwrote {args.out}; run it with  {how}")
    if best.layout.sequence_ranks > 1 and args.model not in SIZES:  # (zerotron train splits its batches itself)
        print(
            f"each sequence is split over {best.layout.sequence_ranks} ranks: feed each rank its part, "
            "zerotron.long_context.shard_batch for a Transformers model (docs/long-context.md)"
        )
    if args.plot:
        plot(candidates, args.plot, hw, title=f"{args.model} on {args.gpus} x {hw.name}, seq {args.seq}")
        print(f"drew {args.plot}")
    return 0
