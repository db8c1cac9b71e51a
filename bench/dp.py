"""Data parallelism side by side: zerotron ZeRO-0 vs torch DDP vs DeepSpeed ZeRO-0, one job, 2 gloo ranks.

    python bench/dp.py                 # re-executes itself under torchrun --standalone, 2 ranks
    python bench/dp.py --no-deepspeed --steps 20 --rounds 5

All systems train the same seeded GPT on the same batches with the same AdamW hyper-parameters;
their losses are compared against DDP's so we know they do the same math.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from bench import common  # noqa: E402
from tools import training  # noqa: E402


def ddp_system(cfg, fused: bool | None, clip):
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(common.build_gpt(cfg))
    opt = torch.optim.AdamW(model.parameters(), fused=fused, **training.ADAMW)

    def buckets():  # gradient_as_bucket_view=False: DDP's buckets are a second copy of the grads
        sizes = str(model._get_ddp_logging_data().get("bucket_sizes", ""))
        return sum(int(b) for b in sizes.split(",") if b.strip())

    return training.torch_step(model, opt, clip), common.measure_after_first_step(opt, model.parameters, buckets)


def deepspeed_system(deepspeed, cfg, per_rank, clip):
    model = common.build_gpt(cfg)
    opt = torch.optim.AdamW(model.parameters(), fused=True, **training.ADAMW)
    config = training.zerotron_config(per_rank, clip, adamw=None)  # clipping explicit: DeepSpeed's default is 1.0
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    return training.engine_step(engine), common.measure_after_first_step(opt, engine.module.parameters)


def main():
    p = common.base_parser(__doc__.splitlines()[0])
    p.add_argument("--clip", type=float, default=0.0, help="gradient clipping max norm for every system (0: off)")
    p.add_argument("--no-deepspeed", action="store_true", help="leave DeepSpeed out even when installed")
    p.add_argument(
        "--bucket-sizes",
        default="",
        help="more zerotron systems, one per reduce_bucket_size "
        "(elements, comma-separated, e.g. 1.7e6): zerotron_bucket_<size>",
    )
    args = p.parse_args()
    rank, world, log, cfg = common.start(args)
    per_rank = args.batch // world

    systems, memory, optimizers, notes = {}, {}, {}, []
    engine, systems["zerotron"] = training.zerotron_step(common.build_gpt(cfg), per_rank, args.clip)
    memory["zerotron"] = common.measure_after_first_step(engine.optimizer, engine.module.parameters)
    optimizers["zerotron"] = "torch AdamW fused=True (zerotron's config optimizer)"
    # reduce_bucket_size 5e8 written out (DeepSpeed's default): the whole model in one bucket, reduced only
    # after backward, against zerotron's unset default (about eight buckets, reduced during backward)
    engine, systems["zerotron_one_bucket"] = training.zerotron_step(
        common.build_gpt(cfg), per_rank, args.clip, zero_optimization={"stage": 0, "reduce_bucket_size": 5e8}
    )
    memory["zerotron_one_bucket"] = common.measure_after_first_step(engine.optimizer, engine.module.parameters)
    optimizers["zerotron_one_bucket"] = optimizers["zerotron"]
    for size in filter(None, args.bucket_sizes.split(",")):
        name = f"zerotron_bucket_{size}"
        engine, systems[name] = training.zerotron_step(
            common.build_gpt(cfg),
            per_rank,
            args.clip,
            zero_optimization={"stage": 0, "reduce_bucket_size": float(size)},
        )
        memory[name] = common.measure_after_first_step(engine.optimizer, engine.module.parameters)
        optimizers[name] = optimizers["zerotron"]
    systems["ddp_fused"], memory["ddp_fused"] = ddp_system(cfg, fused=True, clip=args.clip)
    optimizers["ddp_fused"] = "torch AdamW fused=True"
    systems["ddp_default"], memory["ddp_default"] = ddp_system(cfg, fused=None, clip=args.clip)
    optimizers["ddp_default"] = "torch AdamW defaults (CPU: single-tensor for-loop, no foreach/fused)"
    deepspeed = common.load_deepspeed(args, notes, log)
    if deepspeed is not None:
        systems["deepspeed"], memory["deepspeed"] = deepspeed_system(deepspeed, cfg, per_rank, args.clip)
        optimizers["deepspeed"] = "torch AdamW fused=True (client optimizer)"

    common.announce(log, args, cfg, f"{args.batch} sequences/step on {world} ranks, fp32, clip {args.clip or 'off'}")
    res = common.run_rounds(
        systems, common.batches_for(args, cfg, rank, world), args.warmup, args.steps, args.rounds, log
    )
    rows = list(common.compare(res, "ddp_fused", start=args.warmup).values())
    for r in rows:
        name, mem = r["system"], memory[r["system"]]
        r.update(
            zt_ratio=res["zerotron"]["median_ms"] / r["median_ms"],
            zt_paired=common.paired_ratio(res, "zerotron", name),
            state_mb=mem["total"] / 2**20,
            memory=mem,
            optimizer=optimizers[name],
        )
    overlap = common.pair(res, "zerotron", "zerotron_one_bucket")
    by_size = {
        name: common.pair(res, name, "zerotron_one_bucket") for name in systems if name.startswith("zerotron_bucket_")
    }
    if rank == 0:
        print(
            f"\nbuckets: zerotron / zerotron_one_bucket step time {overlap['ratio']:.3f} (ratio of medians), "
            f"{overlap['paired']:.3f} (paired)"
        )
        for name, pr in by_size.items():
            print(
                f"buckets: {name} / zerotron_one_bucket {pr['ratio']:.3f} (ratio of medians), {pr['paired']:.3f} "
                "(paired)"
            )
        print()
        common.print_table(
            rows,
            [
                ("system", "system", "{}"),
                ("median_ms", "median ms", "{:.1f}"),
                ("zt_ratio", "zerotron/x", "{:.3f}"),
                ("zt_paired", "paired", "{:.3f}"),
                ("loss_diff", "max|dloss| vs ddp_fused", "{:.1e}"),
                ("loss_rel_diff", "relative", "{:.1e}"),
                ("state_mb", "state MiB/rank", "{:.1f}"),
            ],
        )
        print(
            "\nzerotron/x: ratio of the medians; paired: median over rounds of the per-round ratio. State: "
            "params + grads + optimizer state (+ DDP's bucket copy of the grads) after the first step."
        )
        for r in rows:
            mem = ", ".join(f"{k} {v / 2**20:.1f}" for k, v in r["memory"].items() if k != "total" and v)
            print(f"  {r['system']:<12} {r['optimizer']}; MiB: {mem}")
    common.finish(
        "dp",
        args,
        {
            "model": common.model_json(args, cfg, dtype="fp32"),
            "adamw": {**training.ADAMW, "betas": list(training.ADAMW["betas"])},
            "notes": notes,
            "results": rows,
            "buckets_vs_one_bucket": overlap,
            "bucket_sizes_vs_one_bucket": by_size,
        },
        rank,
    )


if __name__ == "__main__":
    main()
