"""The planner's step-time model against measured steps on this machine: ratios, not absolute times.

First the machine is calibrated the way `zerotron plan` describes hardware: the peak matmul rate
of one core and how it falls for narrow matmuls (two matmul widths), the model's efficiency (one
single-process training step), gloo's all-reduce latency and bandwidth between the two ranks
(a small and a large message), and the optimizer's memory bandwidth (one AdamW step). Then
several layouts of the same GPT on the same 2 ranks (DP with ZeRO 0-3, TP with and without
sequence parallelism, a 2-stage pipeline, checkpointing) train side by side in alternating
rounds; each layout's median step time relative to DP 2 / ZeRO-1 is compared with the ratio the
planner predicts from the calibrated hardware. The overlap options are layouts too, each paired
with the layout without it (EFFECTS): the boundary reduction in zerotron's ~8 buckets against one
(reduce_bucket_size 5e8), ZeRO-3's prefetch against none, tensor parallelism in two halves
(tp_overlap_comm) against whole; the calibration also measures how much of an all-reduce a matmul
running beside it hides on this machine (`overlap`).

    python bench/planner.py            # 2 ranks (relaunches itself under torchrun)
"""

from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import torch.distributed as dist

from bench import common
from tools import training

BASE = "dp2 zero1"
ONE_BUCKET = {"reduce_bucket_size": 5e8}  # DeepSpeed's default written out: this model in one bucket
# name: (dp, tp, pp, zero, checkpoint, sequence_parallel[, zero_optimization and tensor_parallel keys])
SYSTEMS = {
    "dp2 zero1": (2, 1, 1, 1, "none", False),
    "dp2 zero0": (2, 1, 1, 0, "none", False),
    "dp2 zero2": (2, 1, 1, 2, "none", False),
    "dp2 zero3": (2, 1, 1, 3, "none", False),
    "dp2 zero1 every_block": (2, 1, 1, 1, "every_block", False),
    "dp2 zero1 selective": (2, 1, 1, 1, "selective", False),
    "tp2": (1, 2, 1, 0, "none", False),
    "tp2 sp": (1, 2, 1, 0, "none", True),
    "pp2 1f1b": (1, 1, 2, 0, "none", False),
    "dp2 zero0 one bucket": (2, 1, 1, 0, "none", False, ONE_BUCKET),
    "dp2 zero1 one bucket": (2, 1, 1, 1, "none", False, ONE_BUCKET),
    "dp2 zero3 no prefetch": (2, 1, 1, 3, "none", False, {"stage3_prefetch_bucket_size": 0}),
    "tp2 overlap": (1, 2, 1, 0, "none", False, {"tp_overlap_comm": True}),
    "tp2 sp overlap": (1, 2, 1, 0, "none", True, {"tp_overlap_comm": True}),
}
# (with the option, without it): the option's effect, measured and predicted
EFFECTS = [
    ("dp2 zero0", "dp2 zero0 one bucket"),
    ("dp2 zero1", "dp2 zero1 one bucket"),
    ("dp2 zero3", "dp2 zero3 no prefetch"),
    ("tp2 overlap", "tp2"),
    ("tp2 sp overlap", "tp2 sp"),
]


def parse_args():
    p = common.base_parser(__doc__, steps=1, rounds=8)
    p.set_defaults(layers=4, d_model=512, heads=8, seq=256, batch=8)
    p.add_argument("--micro-batches", type=int, default=4, help="micro-batches per step in the pipeline layout")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    return p.parse_args()


# ---- calibration ----------------------------------------------------------------------------------
def _timed(fn, repeat: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def calibrate(cfg, args, rank: int) -> dict:
    """The `cpu` hardware fields, measured; every rank measures alike (the cores are shared)."""
    from zerotron.planner.model import ModelShape

    tokens = args.batch // 2 * args.seq
    d = cfg.d_model

    def matmul_rate(width):
        x, w = torch.randn(tokens, d), torch.randn(d, width)
        return 2 * tokens * d * width / _timed(lambda: x @ w)

    r_full, r_half = matmul_rate(4 * d), matmul_rate(2 * d)
    # rate(w) = R * w / (w + knee), with w the hidden width per rank: d and d / 2.
    knee = max(1.0, (r_full - r_half) / (2 * r_half / d - r_full / d))
    peak = r_full * (d + knee) / d

    model = common.build_gpt(cfg)
    opt = torch.optim.AdamW(model.parameters(), **training.ADAMW, fused=True)
    x = torch.randint(0, 256, (args.batch // 2, args.seq))

    def train_step():
        model(x, x).backward()

    step_s = _timed(train_step, 3)
    shape = ModelShape.of_gpt(cfg)
    efficiency = tokens * shape.flops_per_token(args.seq) / step_s / (peak * d / (d + knee))
    adam_s = _timed(lambda: opt.step(), 5)
    hbm = (4 * 4 + 4 * 2 + 4) * shape.parameters / adam_s / 1e9

    def all_reduce_s(n):
        t = torch.zeros(n)
        dist.barrier()
        return _timed(lambda: dist.all_reduce(t), 10)

    small, large = all_reduce_s(256), all_reduce_s(4 * 2**20)  # 1 KiB, 16 MiB
    latency_us = small / 2 * 1e6  # two ring steps for 2 ranks
    bandwidth = 16 * 2**20 / max(large - small, 1e-9) / 1e9  # (n-1)/n * 2 passes = 1 for 2 ranks
    return {
        "peak_tflops": peak / 1e12,
        "knee": knee,
        "efficiency": min(efficiency, 1.0),
        "hbm_gbps": hbm,
        "intra_gbps": bandwidth,
        "inter_gbps": bandwidth,
        "intra_latency_us": latency_us,
        "inter_latency_us": latency_us,
        "overlap": overlap_fraction(tokens, d),
        "model_step_s": step_s,
    }


def overlap_fraction(tokens: int, d: int) -> float:
    """How much of a 16 MiB all-reduce matmuls running beside it hide: (matmuls alone + all-reduce
    alone - both at once) / the shorter of the two; 1 = free, 0 = no better than one after the other."""
    t, x, w = torch.zeros(4 * 2**20), torch.randn(tokens, d), torch.randn(d, 4 * d)
    dist.barrier()
    reduce_s = _timed(lambda: dist.all_reduce(t), 5)
    one = _timed(lambda: x @ w, 5)
    k = max(1, round(reduce_s / one))

    def matmuls():
        for _ in range(k):
            x @ w

    def both():
        work = dist.all_reduce(t, async_op=True)
        matmuls()
        work.wait()

    dist.barrier()
    alone, together = _timed(matmuls, 5), _timed(both, 5)
    return min(1.0, max(0.0, (alone + reduce_s - together) / min(alone, reduce_s)))


# ---- the layouts ----------------------------------------------------------------------------------
def _extra(spec) -> tuple[dict, dict]:
    """The spec's zero_optimization and tensor_parallel keys."""
    extra = spec[6] if len(spec) > 6 else {}
    tp_keys = {"tp_overlap_comm"}
    return ({k: v for k, v in extra.items() if k not in tp_keys}, {k: v for k, v in extra.items() if k in tp_keys})


def system(cfg, args, spec, rank):
    import zerotron

    dp, tp, pp, zero, ckpt, sp = spec[:6]
    zero_keys, tp_keys = _extra(spec)
    model = common.build_gpt(cfg)
    per_rank = args.batch // dp
    m = args.micro_batches if pp > 1 else 1
    config = training.zerotron_config(
        args.batch // dp // m,
        1.0,
        zero,
        gas=m,
        tensor_parallel={"autotp_size": tp, **tp_keys},
        zerotron={"checkpoint_policy": ckpt, "sequence_parallel": sp},
    )
    config["zero_optimization"].update(zero_keys)
    if pp > 1:
        module = common.to_pipeline(model, pp, partition_method="type:_PipeBlock")
        engine, *_ = zerotron.initialize(model=module, config=config)
        return lambda x, y: engine.train_batch(iter(zip(x.tensor_split(m), y.tensor_split(m)))).item()
    engine, *_ = zerotron.initialize(model=model, config=config)
    lo = (rank % dp) * per_rank if dp > 1 else 0
    step = training.engine_step(engine)
    return lambda x, y: step(x[lo : lo + per_rank], y[lo : lo + per_rank])


def predicted(cfg, args, spec, hw) -> float:
    from zerotron.planner.cost import Layout, step_time
    from zerotron.planner.model import ModelShape

    dp, tp, pp, zero, ckpt, sp = spec[:6]
    zero_keys, tp_keys = _extra(spec)
    m = args.micro_batches if pp > 1 else 1
    layout = Layout(
        dp=dp,
        tp=tp,
        pp=pp,
        zero=zero,
        micro_batch=args.batch // dp // m,
        grad_accum=m,
        checkpoint=ckpt,
        sequence_parallel=sp,
        tp_overlap_comm=tp_keys.get("tp_overlap_comm", False),
        stage3_prefetch=int(zero_keys.get("stage3_prefetch_bucket_size", 50_000_000)),
    )
    return step_time(
        ModelShape.of_gpt(cfg), layout, args.seq, hw, dtype="fp32", bucket_elements=zero_keys.get("reduce_bucket_size")
    )


def main():
    args = parse_args()
    rank, world, log, cfg = common.start(args)
    if world != 2:
        raise SystemExit("bench/planner.py compares layouts of 2 ranks; run it with --nproc 2")
    from zerotron.planner.hardware import hardware

    fields = calibrate(cfg, args, rank)
    hw = hardware("cpu", **{k: v for k, v in fields.items() if k != "model_step_s"})
    log("calibrated: " + ", ".join(f"{k} {v:.4g}" for k, v in fields.items()))

    names = [n.strip() for n in args.systems.split(",") if n.strip()]
    systems = {n: system(cfg, args, SYSTEMS[n], rank) for n in names}
    res = common.run_rounds(systems, common.batches_for(args, cfg), args.warmup, args.steps, args.rounds, log)

    rows = []
    for n in names:
        t = predicted(cfg, args, SYSTEMS[n], hw)
        rows.append(
            {
                "layout": n,
                "median_ms": res[n]["median_ms"],
                "predicted_ms": t["total"] * 1e3,
                "measured_ratio": common.paired_ratio(res, n, BASE) if BASE in res else None,
                "parts_ms": {k: v * 1e3 for k, v in t.items()},
            }
        )
    base = next(r for r in rows if r["layout"] == BASE)
    for r in rows:
        r["predicted_ratio"] = r["predicted_ms"] / base["predicted_ms"]
        r["ratio_error"] = r["predicted_ratio"] / r["measured_ratio"] - 1
    if rank == 0:
        common.print_table(
            rows,
            [
                ("layout", "layout", "{}"),
                ("median_ms", "measured ms", "{:.1f}"),
                ("predicted_ms", "predicted ms", "{:.1f}"),
                ("measured_ratio", f"measured / {BASE}", "{:.3f}"),
                ("predicted_ratio", "predicted ratio", "{:.3f}"),
                ("ratio_error", "error", "{:+.1%}"),
            ],
        )
    errors = [abs(r["ratio_error"]) for r in rows if r["layout"] != BASE]
    log(f"ratio error: median {statistics.median(errors):.1%}, worst {max(errors):.1%}")
    by_name = {r["layout"]: r for r in rows}
    effects = [
        {
            "with": a,
            "without": b,
            "measured": common.paired_ratio(res, a, b),
            "predicted": by_name[a]["predicted_ms"] / by_name[b]["predicted_ms"],
        }
        for a, b in EFFECTS
        if a in res and b in res
    ]
    if rank == 0 and effects:
        print()
        common.print_table(
            effects,
            [
                ("with", "with the option", "{}"),
                ("without", "without", "{}"),
                ("measured", "measured ratio (paired)", "{:.3f}"),
                ("predicted", "predicted ratio", "{:.3f}"),
            ],
        )
    common.finish(
        "planner",
        args,
        {
            "calibration": fields,
            "rows": rows,
            "effects": effects,
            "worst_abs_ratio_error": max(errors),
            "median_abs_ratio_error": statistics.median(errors),
        },
        rank,
    )


if __name__ == "__main__":
    main()
