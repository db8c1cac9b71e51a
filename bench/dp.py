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
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from bench import common  # noqa: E402

ADAMW = common.ADAMW


def parse_args():
    p = common.base_parser(__doc__.splitlines()[0])
    p.add_argument("--clip", type=float, default=0.0, help="gradient clipping max norm for every system (0: off)")
    p.add_argument("--no-deepspeed", action="store_true", help="leave DeepSpeed out even when installed")
    return p.parse_args()


def zerotron_system(cfg, per_rank, clip):
    engine, step = common.zerotron_step(common.build_gpt(cfg), per_rank, clip)
    return step, common.measure_after_first_step(engine.optimizer, engine.module.parameters)


def ddp_system(cfg, fused: bool | None, clip):
    from torch.nn.parallel import DistributedDataParallel
    model = DistributedDataParallel(common.build_gpt(cfg))
    opt = torch.optim.AdamW(model.parameters(), fused=fused, **ADAMW)

    def step(tokens, targets):
        loss = model(tokens, targets)
        loss.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        return loss.item()

    def buckets():  # gradient_as_bucket_view=False: DDP's buckets are a second copy of the grads
        sizes = str(model._get_ddp_logging_data().get("bucket_sizes", ""))
        return sum(int(b) for b in sizes.split(",") if b.strip())
    return step, common.measure_after_first_step(opt, model.parameters, buckets)


def deepspeed_system(cfg, per_rank, clip):
    import logging

    import deepspeed
    deepspeed.utils.logger.setLevel(logging.WARNING)
    deepspeed.init_distributed(dist_backend="gloo")  # adopts the gloo group torchrun's job already has
    model = common.build_gpt(cfg)
    opt = torch.optim.AdamW(model.parameters(), fused=True, **ADAMW)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config={
        "train_micro_batch_size_per_gpu": per_rank, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
        "zero_optimization": {"stage": 0}, "gradient_clipping": clip})  # DeepSpeed's default is 1.0

    def step(tokens, targets):
        loss = engine(tokens, targets)
        engine.backward(loss)
        engine.step()
        return loss.item()
    return step, common.measure_after_first_step(opt, engine.module.parameters)


def main():
    args = parse_args()
    rank, world, log, cfg = common.start(args)
    per_rank = args.batch // world

    systems, memory, optimizers, notes = {}, {}, {}, []
    systems["zerotron"], memory["zerotron"] = zerotron_system(cfg, per_rank, args.clip)
    optimizers["zerotron"] = "torch AdamW fused=True (zerotron's config optimizer)"
    systems["ddp_fused"], memory["ddp_fused"] = ddp_system(cfg, fused=True, clip=args.clip)
    optimizers["ddp_fused"] = "torch AdamW fused=True"
    systems["ddp_default"], memory["ddp_default"] = ddp_system(cfg, fused=None, clip=args.clip)
    optimizers["ddp_default"] = "torch AdamW defaults (CPU: single-tensor for-loop, no foreach/fused)"
    if args.no_deepspeed:
        notes.append("DeepSpeed skipped: --no-deepspeed")
    elif common.optional_import("deepspeed") is None:
        notes.append("DeepSpeed skipped: not installed (pip install 'zerotron[bench]')")
    else:
        systems["deepspeed"], memory["deepspeed"] = deepspeed_system(cfg, per_rank, args.clip)
        optimizers["deepspeed"] = "torch AdamW fused=True (client optimizer)"
    for n in notes:
        log(n)

    n_params = sum(p.numel() for p in common.build_gpt(cfg).parameters())
    log(f"GPT {args.layers} layers, d={args.d_model}, {n_params / 1e6:.2f}M params, seq {args.seq}, {args.batch} "
        f"sequences/step on {world} ranks, fp32, clip {args.clip or 'off'}; {args.warmup} warm-up + {args.rounds} "
        f"rounds x {args.steps} timed steps per system; load average {os.getloadavg()[0]:.2f}")
    environment = common.environment()
    total = args.warmup + args.rounds * args.steps
    batches = common.make_batches(total, args.batch, args.seq, cfg.vocab_size, rank, world)
    res = common.run_rounds(systems, batches, args.warmup, args.steps, args.rounds, log=log)

    ref = res["ddp_fused"]["losses_mean_over_ranks"]
    rows = []
    for name, r in res.items():
        diff, rel = common.max_loss_diff(r["losses_mean_over_ranks"], ref, start=args.warmup)
        mem = memory[name]
        rows.append({"system": name, "median_ms": r["median_ms"], "round_ms": r["round_ms"],
                     "zt_ratio": res["zerotron"]["median_ms"] / r["median_ms"],
                     "zt_paired": common.paired_ratio(res, "zerotron", name), "loss_diff": diff,
                     "loss_rel_diff": rel, "state_mb": mem["total"] / 2**20, "memory": mem,
                     "optimizer": optimizers[name], "losses": r["losses_mean_over_ranks"], "step_ms": r["ms"]})
    if rank == 0:
        print()
        common.print_table(rows, [
            ("system", "system", "{}"), ("median_ms", "median ms", "{:.1f}"), ("zt_ratio", "zerotron/x", "{:.3f}"),
            ("zt_paired", "paired", "{:.3f}"), ("loss_diff", "max|dloss| vs ddp_fused", "{:.1e}"),
            ("loss_rel_diff", "relative", "{:.1e}"), ("state_mb", "state MiB/rank", "{:.1f}")])
        print("\nzerotron/x: ratio of the medians; paired: median over rounds of the per-round ratio. State: "
              "params + grads + optimizer state (+ DDP's bucket copy of the grads) after the first step.")
        for r in rows:
            mem = ", ".join(f"{k} {v / 2**20:.1f}" for k, v in r["memory"].items() if k != "total" and v)
            print(f"  {r['system']:<12} {r['optimizer']}; MiB: {mem}")
        path = common.write_json("dp", {
            "benchmark": "dp", "args": {k: str(v) if k == "out" else v for k, v in vars(args).items()},
            "model": {"layers": args.layers, "d_model": args.d_model, "heads": args.heads, "seq": args.seq,
                      "params": n_params, "dtype": "fp32"},
            "adamw": {**ADAMW, "betas": list(ADAMW["betas"])},
            "environment": {**environment, "loadavg_end": os.getloadavg()[0]},
            "notes": notes, "results": rows}, args.out)
        print(f"\nwrote {path}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
