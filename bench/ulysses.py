"""Ulysses attention side by side: zerotron's DistributedAttention and DeepSpeed's on the same q, k, v.

Each rank holds its slice of the sequence ([b, s/sp, h, d]); both run the same local causal attention
(SDPA, grouped key/value heads) between their all-to-alls, forward and backward. Checks that the two
agree (outputs and input gradients, max |difference|) and times a forward+backward of each, alternated
in rounds between barriers. Default: 2 ranks, b 2, s 4096, 8 query and 4 key/value heads of 64.

    python bench/ulysses.py [--seq 4096] [--heads 8] [--kv-heads 4] [--rounds 15]
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench import common  # noqa: E402


def local_attention(q, k, v):
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)


class Local(torch.nn.Module):
    def forward(self, q, k, v, *args, **kwargs):
        return local_attention(q, k, v)


def inputs(args, rank, world):
    g = torch.Generator().manual_seed(0)
    shapes = [(args.batch, args.seq, h, args.head_dim) for h in (args.heads, args.kv_heads, args.kv_heads)]
    full = [torch.randn(s, generator=g) for s in shapes]
    n = args.seq // world
    return [t[:, rank * n : (rank + 1) * n].contiguous() for t in full]


def run(attention, qkv):
    q, k, v = (t.clone().requires_grad_() for t in qkv)
    out = attention(q, k, v, 0)
    out.square().mean().backward()
    return out.detach(), [t.grad for t in (q, k, v)]


def main():
    p = common.base_parser(__doc__.splitlines()[0], steps=1, rounds=15)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--no-deepspeed", action="store_true")
    p.set_defaults(seq=4096, heads=8, batch=2, warmup=2)
    args = p.parse_args()
    common.relaunch_under_torchrun(args.nproc)
    rank, world = common.init_gloo()
    log = print if rank == 0 else (lambda *a, **k: None)
    notes = []
    deepspeed = common.load_deepspeed(args, notes, log)
    from zerotron.long_context import DistributedAttention

    group = dist.new_group(list(range(world)))
    systems = {"zt": DistributedAttention(Local(), group)}
    if deepspeed is not None:
        from deepspeed.sequence.layer import DistributedAttention as DeepSpeedAttention

        systems["ds"] = DeepSpeedAttention(Local(), group)
    qkv = inputs(args, rank, world)
    results = {name: run(a, qkv) for name, a in systems.items()}
    diffs = {}
    if "ds" in results:
        (zo, zg), (do, dg) = results["zt"], results["ds"]
        diffs = {
            "output": (zo - do).abs().max().item(),
            "grads": max((a - b).abs().max().item() for a, b in zip(zg, dg)),
        }
        diffs = {k: common.max_over_ranks(v) for k, v in diffs.items()}
        log(f"zt vs ds: max |output difference| {diffs['output']:.2e}, max |input-gradient difference| ", end="")
        log(f"{diffs['grads']:.2e}")

    def timed(name):
        dist.barrier()
        t0 = time.perf_counter()
        run(systems[name], qkv)
        dist.barrier()
        return (time.perf_counter() - t0) * 1e3

    for name in systems:
        for _ in range(args.warmup):
            timed(name)
    ms, round_ms = common.rounds(list(systems), timed, args.rounds, args.steps)
    rows = [{"system": n, "median_ms": statistics.median(v)} for n, v in ms.items()]
    payload = {"systems": rows, "max_difference": diffs, "notes": notes}
    if "ds" in ms:
        payload["paired_ratio_zt_over_ds"] = common.paired_ratio(
            {n: {"round_ms": v} for n, v in round_ms.items()}, "zt", "ds"
        )
        log(f"zt / ds, paired: {payload['paired_ratio_zt_over_ds']:.3f}")
    if rank == 0:
        common.print_table(rows, [("system", "system", "{}"), ("median_ms", "median ms", "{:.1f}")])
    common.finish("ulysses", args, payload, rank)


if __name__ == "__main__":
    main()
