"""Activation checkpointing: step-time cost and the memory it saves, per policy.

The same seeded GPT, batches and ranks under zerotron with `"zerotron": {"checkpoint_policy": P}`
for P in none, every_block, every_k (every 2nd block), selective; and, as the peer, torch's own
`torch.utils.checkpoint` applied by hand to every block of the same model under DDP. Memory is
what the forward leaves allocated for backward (the profiler's allocation events over one
forward), so it includes what checkpointing keeps internally. Theory for full checkpointing: one
extra forward per step, i.e. a step costs about (F + B + F) / (F + B) ≈ 4/3 of a plain one.
"""
from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import common  # noqa: E402

POLICIES = ("none", "every_block", "every_k", "selective")


def parse_args():
    return common.base_parser(__doc__.splitlines()[0], steps=2, rounds=8).parse_args()


def zerotron_system(cfg, per_rank, policy):
    engine, step = common.zerotron_step(common.build_gpt(cfg), per_rank, 0.0, zerotron={"checkpoint_policy": policy})
    return step, engine.module


def torch_system(cfg):
    """DDP with torch.utils.checkpoint wrapped around every block by hand."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = common.build_gpt(cfg)
    for block in model.layers:
        block.forward = functools.partial(torch.utils.checkpoint.checkpoint, type(block).forward.__get__(block),
                                          use_reentrant=False)
    ddp = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), fused=True, **common.ADAMW)

    def step(tokens, targets):
        loss = ddp(tokens, targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()
    return step, model


def forward_bytes(model, tokens, targets) -> int:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss = model(tokens, targets)
    kept = sum(e.self_cpu_memory_usage for e in prof.events())
    del loss
    return kept


def main():
    args = parse_args()
    rank, world, log, cfg = common.start(args)
    per_rank = args.batch // world
    systems, modules = {}, {}
    for policy in POLICIES:
        systems[f"zt_{policy}"], modules[f"zt_{policy}"] = zerotron_system(cfg, per_rank, policy)
    systems["torch_ckpt"], modules["torch_ckpt"] = torch_system(cfg)
    total = args.warmup + args.rounds * args.steps
    batches = common.make_batches(total, args.batch, args.seq, cfg.vocab_size, rank, world)
    n_params = sum(p.numel() for p in common.build_gpt(cfg).parameters())
    log(f"GPT {args.layers} layers, d={args.d_model}, {n_params / 1e6:.2f}M params, seq {args.seq}, {args.batch} "
        f"sequences/step on {world} ranks, fp32; load average {os.getloadavg()[0]:.2f}")
    kept = {name: forward_bytes(m, *batches[0]) for name, m in modules.items()}
    res = common.run_rounds(systems, batches, args.warmup, args.steps, args.rounds, log=log)
    rows = []
    base = res["zt_none"]
    for name, r in res.items():
        diff, rel = common.max_loss_diff(r["losses_mean_over_ranks"], base["losses_mean_over_ranks"],
                                         start=args.warmup)
        rows.append({"system": name, "median_ms": r["median_ms"], "vs_none": r["median_ms"] / base["median_ms"],
                     "paired_vs_none": common.paired_ratio(res, name, "zt_none"),
                     "zt_every_block_vs_this": common.paired_ratio(res, "zt_every_block", name),
                     "kept_mib": kept[name] / 2**20, "kept_vs_none": kept[name] / kept["zt_none"],
                     "loss_rel_diff": rel, "step_ms": r["ms"]})
    if rank == 0:
        print()
        common.print_table(rows, [
            ("system", "system", "{}"), ("median_ms", "median ms", "{:.1f}"),
            ("paired_vs_none", "time / no ckpt (paired)", "{:.3f}"),
            ("zt_every_block_vs_this", "zt every_block / x", "{:.3f}"),
            ("kept_mib", "kept for backward MiB", "{:.2f}"), ("kept_vs_none", "kept / no ckpt", "{:.3f}"),
            ("loss_rel_diff", "loss rel diff", "{:.1e}")])
        path = common.write_json("checkpointing", {
            "benchmark": "checkpointing", "args": {k: str(v) if k == "out" else v for k, v in vars(args).items()},
            "model": {"layers": args.layers, "d_model": args.d_model, "heads": args.heads, "seq": args.seq,
                      "params": n_params, "dtype": "fp32"},
            "environment": {**common.environment(), "loadavg_end": os.getloadavg()[0]}, "results": rows}, args.out)
        print(f"\nwrote {path}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
