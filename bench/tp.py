"""Tensor parallelism side by side: zerotron vs torch.distributed.tensor.parallel, one job, 2 gloo ranks.

    python bench/tp.py                       # re-executes itself under torchrun --standalone, 2 ranks
    python bench/tp.py --systems zt_tp,torch_tp --rounds 30
    python bench/tp.py --nproc 4 --heads 8   # tensor-parallel size = number of ranks

Tensor-parallel size = world size, no data parallelism: every rank reads the whole batch. Same seeded GPT,
batches, fused AdamW and clipping (default off) for every system; losses against torch_tp's.

  zt_tp     zerotron.initialize(tensor_parallel.autotp_size=N): GPT.tensor_parallel_plan (column-parallel
            q/k/v and w1/w3, row-parallel wo and w2, vocabulary-parallel embedding and loss)
  zt_sp     zt_tp + "zerotron": {"sequence_parallel": true}
  zt_tp_overlap, zt_sp_overlap
            zt_tp, zt_sp + "tensor_parallel": {"tp_overlap_comm": true}: each attention and MLP block runs its
            batch in two halves, one half's collective in flight while the other computes
  torch_tp  parallelize_module with the same split (torch_tp_plan below) and loss_parallel()
  torch_sp  torchtitan's sequence-parallel plan

Pairs: zt_tp vs torch_tp, zt_sp vs torch_sp; zt_tp_overlap vs zt_tp, zt_sp_overlap vs zt_sp.
Memory: params + grads + AdamW state after the first step
(DTensors: the local shard), not activations. The plans in full: bench/README.md.
"""

from __future__ import annotations

import os
import sys
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from bench import common  # noqa: E402
from tools import training  # noqa: E402

warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")

SYSTEMS = ("zt_tp", "zt_sp", "torch_tp", "torch_sp", "zt_tp_overlap", "zt_sp_overlap")
PAIRS = [("zt_tp", "torch_tp"), ("zt_sp", "torch_sp"), ("zt_tp_overlap", "zt_tp"), ("zt_sp_overlap", "zt_sp")]
BASELINE = "torch_tp"


def parse_args():
    p = common.base_parser(__doc__.splitlines()[0], steps=2, rounds=20)
    p.set_defaults(batch=4)
    next(a for a in p._actions if a.dest == "batch").help = "sequences per step; every rank reads all of them"
    p.add_argument("--clip", type=float, default=0.0, help="gradient clipping max norm for every system (0: off)")
    p.add_argument("--systems", default="", help=f"comma-separated subset of {','.join(SYSTEMS)} (default: all)")
    p.add_argument("--no-sp", action="store_true", help="leave the sequence-parallel systems out")
    return p.parse_args()


def zerotron_system(cfg, batch, tp, clip, sequence_parallel, overlap=False):
    engine, step = training.zerotron_step(
        common.build_gpt(cfg),
        batch,
        clip,
        tensor_parallel={"autotp_size": tp, "tp_overlap_comm": overlap},
        zerotron={"sequence_parallel": sequence_parallel},
    )
    return step, common.measure_after_first_step(engine.optimizer, engine.module.parameters)


def torch_tp_plan(model, mesh, sequence_parallel: bool):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    between = Shard(1) if sequence_parallel else Replicate()  # layout of the residual stream
    root = {
        "tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=between),
        "lm_head": ColwiseParallel(input_layouts=between, output_layouts=Shard(-1), use_local_output=False),
    }
    if sequence_parallel:
        root["norm"] = SequenceParallel()
    parallelize_module(model, mesh, root)
    for block in model.layers:
        plan = {
            # Attention.forward(x, cos, sin); MLP.forward(x): hand one Replicate DTensor to q/k/v (w1/w3).
            "attn": PrepareModuleInput(
                input_layouts=(between, None, None), desired_input_layouts=(Replicate(), None, None)
            ),
            "attn.wq": ColwiseParallel(),
            "attn.wk": ColwiseParallel(),
            "attn.wv": ColwiseParallel(),
            "attn.wo": RowwiseParallel(output_layouts=between),
            "mlp": PrepareModuleInput(input_layouts=(between,), desired_input_layouts=(Replicate(),)),
            "mlp.w1": ColwiseParallel(),
            "mlp.w3": ColwiseParallel(),
            "mlp.w2": RowwiseParallel(output_layouts=between),
        }
        if sequence_parallel:
            plan.update({"attn_norm": SequenceParallel(), "mlp_norm": SequenceParallel()})
        parallelize_module(block, mesh, plan)
    return model


def torch_system(cfg, mesh, clip, sequence_parallel):
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel
    from torch.nn.utils import clip_grads_with_norm_, get_total_norm

    model = torch_tp_plan(common.build_gpt(cfg), mesh, sequence_parallel)
    params = list(model.parameters())
    groups = [
        g
        for g in ([p for p in params if isinstance(p, DTensor)], [p for p in params if not isinstance(p, DTensor)])
        if g
    ]
    opt = torch.optim.AdamW([{"params": g} for g in groups], fused=True, **training.ADAMW)

    def clip_grads():
        # clip_grad_norm_ cannot mix DTensor and plain-tensor gradients: norm each group, then combine.
        norms = []
        for g in groups:
            n = get_total_norm([p.grad for p in g if p.grad is not None])
            norms.append(n.full_tensor() if isinstance(n, DTensor) else n)
        total = torch.stack(norms).square().sum().sqrt()
        for g in groups:
            clip_grads_with_norm_(g, clip, total)

    def step(tokens, targets):
        with loss_parallel():
            loss = model(tokens, targets)
            loss.backward()
        if clip > 0:
            clip_grads()
        opt.step()
        opt.zero_grad()
        return loss.to_local().item() if isinstance(loss, DTensor) else loss.item()

    return step, common.measure_after_first_step(opt, model.parameters)


def main():
    args = parse_args()
    rank, world, log, cfg = common.start(args)
    tp = world
    wanted = common.names_arg(args.systems, SYSTEMS)
    if args.no_sp:
        wanted = [s for s in wanted if "_sp" not in s]
    if any("_sp" in s for s in wanted) and args.seq % tp:
        raise SystemExit(f"--seq {args.seq} must be divisible by the {tp} ranks for sequence parallelism")

    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (tp,))
    makers = {
        "zt_tp": lambda: zerotron_system(cfg, args.batch, tp, args.clip, False),
        "zt_sp": lambda: zerotron_system(cfg, args.batch, tp, args.clip, True),
        "torch_tp": lambda: torch_system(cfg, mesh, args.clip, False),
        "torch_sp": lambda: torch_system(cfg, mesh, args.clip, True),
        "zt_tp_overlap": lambda: zerotron_system(cfg, args.batch, tp, args.clip, False, True),
        "zt_sp_overlap": lambda: zerotron_system(cfg, args.batch, tp, args.clip, True, True),
    }
    systems, memory = {}, {}
    for name in SYSTEMS:
        if name in wanted:
            systems[name], memory[name] = makers[name]()

    common.announce(
        log,
        args,
        cfg,
        f"{args.batch} sequences/step on each of {world} tensor-parallel ranks, fp32, clip {args.clip or 'off'}",
    )
    # Tensor parallelism: every rank of the group reads the same whole batch.
    res = common.run_rounds(systems, common.batches_for(args, cfg), args.warmup, args.steps, args.rounds, log=log)

    baseline = BASELINE if BASELINE in res else next(iter(res))
    rows = list(common.compare(res, baseline).values())
    for r in rows:
        mem = memory[r["system"]]
        r.update(state_mb=mem["total"] / 2**20, memory=mem)
    pairs = [
        {"zerotron": a, "torch": b, "pair": f"{a} / {b}", **common.pair(res, a, b)}
        for a, b in PAIRS
        if a in res and b in res
    ]
    if rank == 0:
        print()
        common.print_table(
            rows,
            [
                ("system", "system", "{}"),
                ("median_ms", "median ms", "{:.1f}"),
                ("loss_diff", f"max|dloss| vs {baseline}", "{:.1e}"),
                ("loss_rel_diff", "relative", "{:.1e}"),
                ("state_mb", "state MiB/rank", "{:.2f}"),
            ],
        )
        if pairs:
            print()
            common.print_table(
                pairs,
                [
                    ("pair", "a / b", "{}"),
                    ("ratio", "ratio of medians", "{:.3f}"),
                    ("paired", "paired", "{:.3f}"),
                    ("loss_diff", "max|dloss|", "{:.1e}"),
                ],
            )
        print(
            "\nratio < 1: zerotron is faster. paired: median over rounds of the per-round ratio (prefer it on a "
            "shared machine). max|dloss| over every step, warm-up included. State: params + grads + AdamW "
            "state per rank after the first step (not activations)."
        )
    common.finish(
        "tp",
        args,
        {
            "model": common.model_json(args, cfg, dtype="fp32", tensor_parallel=tp),
            "adamw": {**training.ADAMW, "betas": list(training.ADAMW["betas"]), "fused": True},
            "baseline": baseline,
            "pairs": pairs,
            "results": rows,
        },
        rank,
    )


if __name__ == "__main__":
    main()
