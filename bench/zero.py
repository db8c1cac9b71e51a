"""ZeRO stages side by side: zerotron stages 1-3 vs torch ZeroRedundancyOptimizer, FSDP2 and DeepSpeed, one job.

    python bench/zero.py                      # re-executes itself under torchrun --standalone, 2 ranks
    python bench/zero.py --precision fp32 --no-deepspeed --rounds 5
    python bench/zero.py --systems zt3,fsdp2_reshard --precision bf16

Same seeded GPT, batches, fused AdamW and gradient clipping for every system; losses against a baseline of
the same precision (torch DDP in fp32, zerotron stage 0 in bf16). Pairs (PAIRS): zt1 vs torch_zero1 and ds1,
zt2 vs fsdp2_noreshard and ds2, zt3 (and zt3_fsdp, stage 3 set up as FSDP2 works) vs fsdp2_reshard and ds3.
Memory is model state as tensor bytes reachable from each system's objects, sampled around every block and
optimizer step of one untimed step (MemoryProbe); the peak is reported. The systems: zero_systems.py; the
memory probe: zero_memory.py. Details: bench/README.md.
"""

from __future__ import annotations

import gc
import os
import sys
import time
import warnings

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from bench import common  # noqa: E402
from bench.zero_systems import HOLDS, block_numel, build_systems  # noqa: E402
from tools import reporting, training  # noqa: E402

# DeepSpeed and FSDP2 call collectives that torch 2.13 renamed; one warning per call buries the tables.
warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")

ADAMW = training.ADAMW
# zerotron system -> the peers it is compared with
PAIRS = {
    "zt1": ["torch_zero1", "ds1"],
    "zt2": ["fsdp2_noreshard", "ds2"],
    "zt2_fsdp": ["fsdp2_noreshard", "ds2"],
    "zt3": ["fsdp2_reshard", "ds3"],
    "zt3_fsdp": ["fsdp2_reshard", "ds3"],
}


def parse_args():
    p = common.base_parser(__doc__.splitlines()[0])
    p.add_argument(
        "--precision",
        choices=["fp32", "bf16", "both"],
        default="fp32",
        help="fp32, bf16 (bf16 weights and gradients, fp32 masters), or both (one sweep each). "
        "Default fp32: this CPU has no bf16 matrix unit, a bf16 step is ~10x slower",
    )
    p.add_argument("--bf16-rounds", type=int, default=5, help="rounds of the bf16 sweep (its steps take ~4 s)")
    p.add_argument("--clip", type=float, default=1.0, help="gradient clipping max norm for every system (0: off)")
    p.add_argument(
        "--reduce-bucket-size",
        type=float,
        default=1e6,
        help="zerotron's and DeepSpeed's reduce_bucket_size and allgather_bucket_size (elements). "
        "Not their 5e8 default: DeepSpeed preallocates reduce_bucket_size elements for its "
        "gradient bucket (2 GB in fp32), which would swamp the memory comparison",
    )
    p.add_argument(
        "--stage3-threshold",
        type=float,
        default=1e5,
        help="stage3_param_persistence_threshold for zt3 and ds3 (DeepSpeed's default 1e5)",
    )
    p.add_argument(
        "--stage3-reuse",
        type=float,
        default=0,
        help="stage3_max_reuse_distance for zt3 and ds3 (0: release after each forward, as FSDP2's "
        "reshard_after_forward; DeepSpeed's default 1e9 keeps small models gathered until backward)",
    )
    p.add_argument(
        "--stage3-prefetch",
        type=float,
        default=5e7,
        help="stage3_prefetch_bucket_size for zt3 and ds3 (both default to 5e7)",
    )
    p.add_argument(
        "--no-zt3-fsdp",
        action="store_true",
        help="leave out zt2_fsdp and zt3_fsdp, zerotron set up as FSDP2 works: stage 2 with "
        "reshard_after_backward and overlap_param_gather; stage 3 with threshold 0 and a one-block prefetch",
    )
    p.add_argument("--no-deepspeed", action="store_true", help="leave DeepSpeed out even when installed")
    p.add_argument("--systems", default="", help="comma-separated subset of systems to run (default: all)")
    p.add_argument(
        "--profile",
        default="",
        help="comma-separated systems to profile after the timed rounds: "
        "torch.profiler on rank 0, tables in bench/results/zero_profile_<precision>_<system>.txt",
    )
    p.add_argument("--profile-steps", type=int, default=4, help="steps per profiled system")
    return p.parse_args()


# ---- sweeps and reporting ------------------------------------------------------------------------
def sweep(precision, cfg, per_rank, rank, world, args, use_deepspeed, mesh, wanted, log):
    systems, probes, infos = build_systems(precision, cfg, per_rank, world, args, use_deepspeed, mesh, wanted)
    batches = common.batches_for(args, cfg, rank, world, rounds=max(args.rounds, args.bf16_rounds))
    log(f"\n== {precision}: {', '.join(systems)}")
    rounds = args.bf16_rounds if precision == "bf16" else args.rounds
    res = common.run_rounds(systems, batches, args.warmup, args.steps, rounds, log=log)

    for name in [s.strip() for s in args.profile.split(",") if s.strip()]:
        if name in systems:
            profile(name, systems[name], batches, precision, args, rank, log)

    base = "ddp" if precision == "fp32" else "zt0"
    if base not in res:
        base = next(iter(res))
    rows = common.compare(res, base, start=args.warmup)
    for name, row in rows.items():
        peak = probes[name].peak
        # the peak of either rank (they can differ by a padding element or a shard boundary)
        row.update(
            state_mb=peak.get("total", 0) / 2**20,
            state_mb_max_rank=common.max_over_ranks(peak.get("total", 0)) / 2**20,
            peak=peak,
            samples=probes[name].samples,
            holds=HOLDS[precision].get(name, ""),
        )
        info = infos[name]
        if "engine" in info:  # zerotron: the engine's own count, after the run, as a cross-check
            row["memory_report"] = info["engine"].memory_report()
        row.update({k: v for k, v in info.items() if k != "engine"})
    pairs = [
        {
            "zerotron": zt,
            "peer": peer,
            "time_ratio": res[zt]["median_ms"] / res[peer]["median_ms"],
            "time_paired": common.paired_ratio(res, zt, peer),
            "mem_ratio": rows[zt]["state_mb"] / rows[peer]["state_mb"],
        }
        for zt, peers in PAIRS.items()
        for peer in peers
        if zt in res and peer in res
    ]
    # free this sweep's models before the next one
    del systems, probes, infos
    gc.collect()
    return {"baseline": base, "rounds": rounds, "steps": args.steps, "rows": list(rows.values()), "pairs": pairs}


def profile(name, step, batches, precision, args, rank, log):
    """Run `args.profile_steps` steps of one system under torch.profiler (rank 0; the other ranks
    just run) and write its phases and its top operators by self CPU time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    ctx = torch_profile(activities=[ProfilerActivity.CPU]) if rank == 0 else None
    dist.barrier()
    if ctx is not None:
        ctx.__enter__()
    t0 = time.perf_counter()
    for i in range(args.profile_steps):
        tokens, targets = batches[i % len(batches)]
        step(tokens, targets)
    dist.barrier()
    wall = (time.perf_counter() - t0) * 1e3 / args.profile_steps
    if ctx is None:
        return
    ctx.__exit__(None, None, None)
    events = ctx.key_averages()
    phases = {e.key: e.cpu_time_total / 1e3 / args.profile_steps for e in events if e.key.startswith("phase:")}
    lines = [
        f"{name} ({precision}), rank 0, {args.profile_steps} steps, {wall:.1f} ms/step with the profiler on",
        "phases, ms/step: " + ", ".join(f"{k[6:]} {v:.1f}" for k, v in phases.items()),
        "",
        events.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60),
    ]
    path = (args.out.parent if args.out else reporting.RESULTS) / f"zero_profile_{precision}_{name}.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    log(f"profile of {name}: {lines[1]} -> {path}")


def print_sweep(precision, out, args):
    print(
        f"\n{precision}: median step ms over {out['rounds']} rounds x {out['steps']} steps; "
        f"loss vs {out['baseline']}; "
        "state = peak model-state tensor bytes per rank (rank 0)"
    )
    common.print_table(
        out["rows"],
        [
            ("system", "system", "{}"),
            ("median_ms", "median ms", "{:.1f}"),
            ("loss_diff", f"max|dloss| vs {out['baseline']}", "{:.1e}"),
            ("loss_rel_diff", "relative", "{:.1e}"),
            ("state_mb", "state MiB/rank", "{:.2f}"),
        ],
    )
    print()
    common.print_table(
        out["pairs"],
        [
            ("zerotron", "zerotron", "{}"),
            ("peer", "peer", "{}"),
            ("time_ratio", "time zt/peer", "{:.3f}"),
            ("time_paired", "paired", "{:.3f}"),
            ("mem_ratio", "memory zt/peer", "{:.3f}"),
        ],
    )
    print("\npeak model state, MiB/rank (where it peaked): params / grads / optimizer / masters / other")
    for r in out["rows"]:
        p = r["peak"]
        if p:
            print(
                f"  {r['system']:<16} {p['total'] / 2**20:7.2f} ({p['at']}): "
                + " / ".join(f"{p[k] / 2**20:.2f}" for k in ("params", "grads", "optimizer", "masters", "other"))
            )


def main():
    args = parse_args()
    rank, world, log, cfg = common.start(args)
    per_rank = args.batch // world
    wanted = {s.strip() for s in args.systems.split(",") if s.strip()}
    if args.warmup < 2:
        raise SystemExit("--warmup must be at least 2 (memory is sampled in the second, untimed, step)")
    notes = []
    use_deepspeed = common.load_deepspeed(args, notes, log) is not None
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))

    precisions = ["fp32", "bf16"] if args.precision == "both" else [args.precision]
    common.announce(
        log,
        args,
        cfg,
        f"{args.batch} sequences/step on {world} ranks, {'+'.join(precisions)}, AdamW "
        f"fused, clip {args.clip or 'off'}, reduce/allgather bucket {args.reduce_bucket_size:.0e}, stage-3 "
        f"threshold {args.stage3_threshold:.0e} prefetch {args.stage3_prefetch:.0e}",
    )
    sweeps = {}
    for precision in precisions:
        sweeps[precision] = sweep(precision, cfg, per_rank, rank, world, args, use_deepspeed, mesh, wanted, log)
    if rank == 0:
        for precision, out in sweeps.items():
            print_sweep(precision, out, args)
        print(
            "\ntime zt/peer: ratio of the medians; paired: median over rounds of the per-round ratio (prefer it). "
            "memory zt/peer: peak model-state bytes, zerotron / peer."
        )
    common.finish(
        "zero",
        args,
        {
            "model": common.model_json(args, cfg, block_numel=block_numel(cfg, world)),
            "adamw": {**ADAMW, "betas": list(ADAMW["betas"]), "fused": True},
            "pairs": PAIRS,
            "notes": notes,
            "sweeps": sweeps,
        },
        rank,
    )


if __name__ == "__main__":
    main()
