"""Tensor parallelism side by side: zerotron vs torch.distributed.tensor.parallel, one job, 2 gloo ranks.

    python bench/tp.py                       # re-executes itself under torchrun --standalone, 2 ranks
    python bench/tp.py --systems zt_tp,torch_tp --rounds 30
    python bench/tp.py --nproc 4 --heads 8   # tensor-parallel size = number of ranks

Every rank is one tensor-parallel rank (tensor-parallel size = world size, no data parallelism), so
every rank sees the whole batch. All systems train the same seeded GPT on the same batches with
torch AdamW (fused=True; lr 1e-3, betas 0.9/0.95, eps 1e-8, weight decay 0.1) and the same gradient
clipping (default off); losses are compared against torch_tp's so we know they do the same math.

What each system splits (per transformer block; the embedding, head and loss as noted):

  zt_tp     zerotron.initialize(tensor_parallel.autotp_size=N, zero stage 0): GPT.tensor_parallel_plan,
            i.e. wq/wk/wv and w1/w3 column-parallel (whole heads per rank), wo and w2 row-parallel,
            the embedding vocabulary-parallel (outputs all-reduced), lm_head column-parallel with its
            logits left split and a vocabulary-parallel cross-entropy. Norms and the residual stream
            replicated. Per block: 2 all-reduces forward (after wo, after w2) and 2 backward (q/k/v
            share one entry into the parallel region, as do w1/w3).
  zt_sp     zt_tp + "zerotron": {"sequence_parallel": true}: norms and residuals split along the
            sequence; every all-reduce becomes an all-gather before the column layers plus a
            reduce-scatter after the row layers; norm-weight gradients summed over the group.
  torch_tp  parallelize_module on DeviceMesh("cpu", (N,)): ColwiseParallel for wq/wk/wv/w1/w3,
            RowwiseParallel for wo/w2, PrepareModuleInput(Replicate -> Replicate, use_local_output=False)
            on attn and mlp so q/k/v (and w1/w3) read one DTensor and backward sums their input
            gradients before one all-reduce (as zerotron does); tok_emb RowwiseParallel(input_layouts=
            Replicate()) (vocabulary-parallel, output all-reduced), lm_head ColwiseParallel(output_layouts=
            Shard(-1), use_local_output=False) and the model's own F.cross_entropy under loss_parallel().
            Norm weights stay plain tensors (replicated); AdamW gets two param groups (DTensor / plain
            tensor: fused AdamW refuses a mix) with the same hyper-parameters.
  torch_sp  torchtitan's plan: torch_tp plus SequenceParallel() on the norms, tok_emb output Shard(1),
            wo/w2 RowwiseParallel(output_layouts=Shard(1)), PrepareModuleInput(Shard(1) -> Replicate) on
            attn and mlp, lm_head ColwiseParallel(input_layouts=Shard(1)); every parameter a DTensor.

Pairs: zt_tp vs torch_tp, zt_sp vs torch_sp. Memory is model state (params + grads + AdamW state)
as tensor bytes after the first optimizer step (DTensors: the local shard); it does not see
activations, which is where sequence parallelism saves.
"""
from __future__ import annotations

import os
import sys
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from bench import common  # noqa: E402

warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")

ADAMW = common.ADAMW
SYSTEMS = ("zt_tp", "zt_sp", "torch_tp", "torch_sp")
PAIRS = [("zt_tp", "torch_tp"), ("zt_sp", "torch_sp")]
BASELINE = "torch_tp"


def parse_args():
    p = common.base_parser(__doc__.splitlines()[0], steps=2, rounds=20)
    p.set_defaults(batch=4)
    next(a for a in p._actions if a.dest == "batch").help = "sequences per step; every rank reads all of them"
    p.add_argument("--clip", type=float, default=0.0, help="gradient clipping max norm for every system (0: off)")
    p.add_argument("--systems", default="", help=f"comma-separated subset of {','.join(SYSTEMS)} (default: all)")
    p.add_argument("--no-sp", action="store_true", help="leave the sequence-parallel systems out")
    return p.parse_args()


# ---- zerotron -------------------------------------------------------------------------------------
def zerotron_system(cfg, batch, tp, clip, sequence_parallel):
    engine, step = common.zerotron_step(common.build_gpt(cfg), batch, clip, tensor_parallel={"autotp_size": tp},
                                        zerotron={"sequence_parallel": sequence_parallel})
    return step, common.measure_after_first_step(engine.optimizer, engine.module.parameters)


# ---- torch.distributed.tensor.parallel --------------------------------------------------------------
def torch_tp_plan(model, mesh, sequence_parallel: bool):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)
    between = Shard(1) if sequence_parallel else Replicate()  # layout of the residual stream
    root = {"tok_emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=between),
            "lm_head": ColwiseParallel(input_layouts=between, output_layouts=Shard(-1), use_local_output=False)}
    if sequence_parallel:
        root["norm"] = SequenceParallel()
    parallelize_module(model, mesh, root)
    for block in model.layers:
        plan = {
            # Attention.forward(x, cos, sin); MLP.forward(x): hand one Replicate DTensor to q/k/v (w1/w3).
            "attn": PrepareModuleInput(input_layouts=(between, None, None),
                                       desired_input_layouts=(Replicate(), None, None)),
            "attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(), "attn.wv": ColwiseParallel(),
            "attn.wo": RowwiseParallel(output_layouts=between),
            "mlp": PrepareModuleInput(input_layouts=(between,), desired_input_layouts=(Replicate(),)),
            "mlp.w1": ColwiseParallel(), "mlp.w3": ColwiseParallel(),
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
    groups = [g for g in ([p for p in params if isinstance(p, DTensor)],
                          [p for p in params if not isinstance(p, DTensor)]) if g]
    opt = torch.optim.AdamW([{"params": g} for g in groups], fused=True, **ADAMW)

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
    wanted = [s.strip() for s in args.systems.split(",") if s.strip()] or list(SYSTEMS)
    unknown = set(wanted) - set(SYSTEMS)
    if unknown:
        raise SystemExit(f"unknown systems {sorted(unknown)}; choose from {', '.join(SYSTEMS)}")
    if args.no_sp:
        wanted = [s for s in wanted if not s.endswith("_sp")]
    if any(s.endswith("_sp") for s in wanted) and args.seq % tp:
        raise SystemExit(f"--seq {args.seq} must be divisible by the {tp} ranks for sequence parallelism")

    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (tp,))
    makers = {"zt_tp": lambda: zerotron_system(cfg, args.batch, tp, args.clip, False),
              "zt_sp": lambda: zerotron_system(cfg, args.batch, tp, args.clip, True),
              "torch_tp": lambda: torch_system(cfg, mesh, args.clip, False),
              "torch_sp": lambda: torch_system(cfg, mesh, args.clip, True)}
    systems, memory = {}, {}
    for name in SYSTEMS:
        if name in wanted:
            systems[name], memory[name] = makers[name]()

    n_params = sum(p.numel() for p in common.build_gpt(cfg).parameters())
    log(f"GPT {args.layers} layers, d={args.d_model}, {args.heads} heads, {n_params / 1e6:.2f}M params, seq "
        f"{args.seq}, {args.batch} sequences/step on each of {world} tensor-parallel ranks, fp32, clip "
        f"{args.clip or 'off'}; {args.warmup} warm-up + {args.rounds} rounds x {args.steps} timed steps per "
        f"system; load average {os.getloadavg()[0]:.2f}")
    environment = common.environment()
    total = args.warmup + args.rounds * args.steps
    # Tensor parallelism: every rank of the group reads the same whole batch.
    batches = common.make_batches(total, args.batch, args.seq, cfg.vocab_size, rank=0, world=1)
    res = common.run_rounds(systems, batches, args.warmup, args.steps, args.rounds, log=log)

    baseline = BASELINE if BASELINE in res else next(iter(res))
    ref = res[baseline]["losses_mean_over_ranks"]
    rows = []
    for name, r in res.items():
        diff, rel = common.max_loss_diff(r["losses_mean_over_ranks"], ref, start=0)
        mem = memory[name]
        rows.append({"system": name, "median_ms": r["median_ms"], "round_ms": r["round_ms"], "loss_diff": diff,
                     "loss_rel_diff": rel, "state_mb": mem["total"] / 2**20, "memory": mem,
                     "losses": r["losses_mean_over_ranks"], "step_ms": r["ms"]})
    pairs = [{"zerotron": a, "torch": b, "median_zt_ms": res[a]["median_ms"], "median_torch_ms": res[b]["median_ms"],
              "ratio": res[a]["median_ms"] / res[b]["median_ms"], "paired": common.paired_ratio(res, a, b),
              "loss_diff": common.max_loss_diff(res[a]["losses_mean_over_ranks"], res[b]["losses_mean_over_ranks"])[0]}
             for a, b in PAIRS if a in res and b in res]
    if rank == 0:
        print()
        common.print_table(rows, [
            ("system", "system", "{}"), ("median_ms", "median ms", "{:.1f}"),
            ("loss_diff", f"max|dloss| vs {baseline}", "{:.1e}"), ("loss_rel_diff", "relative", "{:.1e}"),
            ("state_mb", "state MiB/rank", "{:.2f}")])
        if pairs:
            print()
            for p in pairs:
                p["pair"] = f"{p['zerotron']} / {p['torch']}"
            common.print_table(pairs, [("pair", "zerotron / torch", "{}"), ("ratio", "ratio of medians", "{:.3f}"),
                                       ("paired", "paired", "{:.3f}"), ("loss_diff", "max|dloss|", "{:.1e}")])
        print("\nratio < 1: zerotron is faster. paired: median over rounds of the per-round ratio (prefer it on a "
              "shared machine). max|dloss| over every step, warm-up included. State: params + grads + AdamW "
              "state per rank after the first step (not activations).")
        path = common.write_json("tp", {
            "benchmark": "tp", "args": {k: str(v) if k == "out" else v for k, v in vars(args).items()},
            "model": {"layers": args.layers, "d_model": args.d_model, "heads": args.heads, "seq": args.seq,
                      "params": n_params, "dtype": "fp32", "tensor_parallel": tp},
            "adamw": {**ADAMW, "betas": list(ADAMW["betas"]), "fused": True},
            "environment": {**environment, "loadavg_end": os.getloadavg()[0]},
            "baseline": baseline, "pairs": pairs, "results": rows}, args.out)
        print(f"\nwrote {path}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
