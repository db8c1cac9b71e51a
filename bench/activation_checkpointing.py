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
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import common  # noqa: E402
from tools import training  # noqa: E402

POLICIES = ("none", "every_block", "every_k", "selective")


def torch_system(cfg):
    """DDP with torch.utils.checkpoint wrapped around every block by hand."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = common.build_gpt(cfg)
    for block in model.layers:
        block.forward = functools.partial(
            torch.utils.checkpoint.checkpoint, type(block).forward.__get__(block), use_reentrant=False
        )
    return training.torch_step(DDP(model), torch.optim.AdamW(model.parameters(), fused=True, **training.ADAMW)), model


def forward_bytes(model, tokens, targets) -> int:
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss = model(tokens, targets)
    kept = sum(e.self_cpu_memory_usage for e in prof.events())
    del loss
    return kept


def main():
    args = common.base_parser(__doc__.splitlines()[0], steps=2, rounds=8).parse_args()
    rank, world, log, cfg = common.start(args)
    systems, modules = {}, {}
    for policy in POLICIES:
        engine, systems[f"zt_{policy}"] = training.zerotron_step(
            common.build_gpt(cfg), args.batch // world, 0.0, zerotron={"checkpoint_policy": policy}
        )
        modules[f"zt_{policy}"] = engine.module
    systems["torch_ckpt"], modules["torch_ckpt"] = torch_system(cfg)
    batches = common.batches_for(args, cfg, rank, world)
    common.announce(log, args, cfg, f"{args.batch} sequences/step on {world} ranks, fp32")
    kept = {name: forward_bytes(m, *batches[0]) for name, m in modules.items()}
    res = common.run_rounds(systems, batches, args.warmup, args.steps, args.rounds, log=log)
    rows = list(common.compare(res, "zt_none", start=args.warmup).values())
    for r in rows:
        name = r["system"]
        r.update(
            vs_none=r["median_ms"] / res["zt_none"]["median_ms"],
            paired_vs_none=common.paired_ratio(res, name, "zt_none"),
            zt_every_block_vs_this=common.paired_ratio(res, "zt_every_block", name),
            kept_mib=kept[name] / 2**20,
            kept_vs_none=kept[name] / kept["zt_none"],
        )
    if rank == 0:
        print()
        common.print_table(
            rows,
            [
                ("system", "system", "{}"),
                ("median_ms", "median ms", "{:.1f}"),
                ("paired_vs_none", "time / no ckpt (paired)", "{:.3f}"),
                ("zt_every_block_vs_this", "zt every_block / x", "{:.3f}"),
                ("kept_mib", "kept for backward MiB", "{:.2f}"),
                ("kept_vs_none", "kept / no ckpt", "{:.3f}"),
                ("loss_rel_diff", "loss rel diff", "{:.1e}"),
            ],
        )
    common.finish("checkpointing", args, {"model": common.model_json(args, cfg, dtype="fp32"), "results": rows}, rank)


if __name__ == "__main__":
    main()
