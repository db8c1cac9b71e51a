"""DeepSpeed-MoE training steps side by side: one script in DeepSpeed-MoE's style (layers of
`deepspeed.moe.layer.MoE` with `ep_size` 2, the optimizer groups from
`split_params_into_different_moe_groups_for_optimizer`, ZeRO-2) under real DeepSpeed and under zerotron
through the `deepspeed` alias, 2 gloo ranks, every expert on one of them.

Each round starts both systems in turn (the order alternates); each times `--steps` steps after
`--warmup` between barriers and reports its median step, its peak resident memory (rank 0, the
process's high-water mark: model states, activations, communication buffers) and its losses; the
result is each system's median over rounds and the paired ratio (zerotron / DeepSpeed, per round).
DeepSpeed runs in its own interpreter (`--ds-python`: deepspeed==0.19.8 and the same torch).

    python bench/moe_step.py --ds-python /path/to/ds-venv/bin/python [--k 2] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
ROOT = HERE.parent.parent


def worker(args):
    import deepspeed
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F
    from deepspeed.moe.layer import MoE
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    h = args.hidden

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed, self.head = nn.Embedding(args.vocab, h), nn.Linear(h, args.vocab)
            self.dense = nn.ModuleList(nn.Linear(h, h) for _ in range(args.layers))
            expert = nn.Sequential(nn.Linear(h, 4 * h), nn.GELU(), nn.Linear(4 * h, h))
            self.moe = nn.ModuleList(
                MoE(
                    h,
                    expert,
                    num_experts=args.experts,
                    ep_size=2,
                    k=args.k,
                    min_capacity=4,
                    use_rts=False,
                    drop_tokens=args.k == 1,
                    top2_2nd_expert_sampling=False,
                )  # fmt: skip
                for _ in range(args.layers)
            )

        def forward(self, ids, targets):
            x, aux = self.embed(ids), 0.0
            for dense, moe in zip(self.dense, self.moe):
                x = x + F.gelu(dense(x))
                out, l_aux, _ = moe(x)
                x, aux = x + out, aux + l_aux
            return F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten()) + 0.01 * aux

    model = Net()
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()), "name": "p"})
    config = {
        "train_micro_batch_size_per_gpu": args.batch,
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "torch_adam": True}},
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
    }
    engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=groups)
    g = torch.Generator().manual_seed(dist.get_rank())
    batches = [torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g) for _ in range(args.steps)]
    times, losses = [], []
    for i in range(args.warmup + args.steps):
        ids = batches[i % args.steps]
        dist.barrier()
        t0 = time.perf_counter()
        loss = engine(ids[:, :-1], ids[:, 1:])
        engine.backward(loss)
        engine.step()
        dist.barrier()
        if i >= args.warmup:
            times.append((time.perf_counter() - t0) * 1e3)
            losses.append(loss.item())
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps({"median_ms": statistics.median(times), "peak_rss_mib": peak_mib,
                                      "losses": losses}), flush=True)  # fmt: skip
    dist.destroy_process_group()


def _launch(system: str, args) -> dict:
    python = args.ds_python if system == "ds" else sys.executable
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    if system == "zt":
        env.update(ZEROTRON_AS_DEEPSPEED="1", PYTHONPATH=str(ROOT))
    cmd = [python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(HERE), "--worker"]
    for name in ("hidden", "layers", "experts", "k", "vocab", "batch", "seq", "steps", "warmup"):
        cmd += [f"--{name}", str(getattr(args, name))]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    found = re.findall(r"RESULT (\{.*\})", done.stdout)
    if done.returncode or not found:
        raise SystemExit(f"{system} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return json.loads(found[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ds-python", default=os.environ.get("DS_PYTHON"))
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--k", type=int, default=2, help="experts per token (2: dropless; 1: capacity 1.0)")
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help="default: bench/results/moe_step_k<K>.json")
    args = p.parse_args()
    if args.worker:
        return worker(args)
    if not args.ds_python:
        raise SystemExit("--ds-python: the interpreter of an environment with DeepSpeed (or set DS_PYTHON)")
    rounds = []
    for r in range(args.rounds):
        order = ("zt", "ds") if r % 2 == 0 else ("ds", "zt")
        rounds.append({s: _launch(s, args) for s in order})
        print(f"round {r}: " + ", ".join(f"{s} {rounds[-1][s]['median_ms']:.1f} ms" for s in order), flush=True)
    medians = {s: statistics.median(x[s]["median_ms"] for x in rounds) for s in ("zt", "ds")}
    peaks = {s: statistics.median(x[s]["peak_rss_mib"] for x in rounds) for s in ("zt", "ds")}
    paired = statistics.median(x["zt"]["median_ms"] / x["ds"]["median_ms"] for x in rounds)
    loss_rel = max(abs(a - b) / abs(b) for x in rounds for a, b in zip(x["zt"]["losses"], x["ds"]["losses"]))
    print(
        f"median step: zerotron {medians['zt']:.1f} ms, DeepSpeed {medians['ds']:.1f} ms; paired zt/ds {paired:.3f}; "
        f"peak RSS zerotron {peaks['zt']:.0f} MiB, DeepSpeed {peaks['ds']:.0f} MiB; losses within {loss_rel:.1e}"
    )
    payload = {"args": vars(args), "median_ms": medians, "paired_ratio_zt_over_ds": paired, "rounds": rounds}
    payload.update(peak_rss_mib=peaks, max_loss_rel_diff=loss_rel)
    out = Path(args.out or HERE.parent / "results" / f"moe_step_k{args.k}.json")
    out.write_text(json.dumps(payload, indent=1))


if __name__ == "__main__":
    main()
