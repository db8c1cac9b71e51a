"""One job of the soak test (tests/faults/soak.py): the tiny GPT trained by a DeepSpeed-style script on 2
ranks, checkpointing every 2 steps and resuming from the newest checkpoint, with the fault it is
told to inject. Batches are a function of the step, so a resumed run sees exactly the data an
uninterrupted one would.

    zerotron run -n 2 [--max-restarts K] tests/faults/soak_job.py --save-dir D --steps N [fault flags]
"""

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as dist

import zerotron
from zerotron.models.gpt import GPT, config_for


def parse_args():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--save-dir", required=True)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--zero", type=int, default=1)
    p.add_argument("--nan-steps", default="", help="steps whose loss is NaN on rank 1 (comma-separated)")
    p.add_argument("--skip-step", type=int, default=-1, help="rank 1 skips this step (a diverging branch)")
    p.add_argument("--timeout", type=float, default=5.0, help="collective timeout, seconds")
    return p.parse_args()


def batch(step: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randint(0, 256, (4, 33), generator=g)
    return x[:, :-1], x[:, 1:]


def main():
    args = parse_args()
    zerotron.init_distributed()
    rank = dist.get_rank()
    torch.manual_seed(0)
    engine, *_ = zerotron.initialize(
        model=GPT(config_for("tiny", max_seq_len=32)),
        config={
            "train_micro_batch_size_per_gpu": 4,
            "gradient_clipping": 1.0,
            "steps_per_print": 10**9,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": args.zero},
            "zerotron": {
                "collective_timeout": args.timeout,
                "save_on_preemption": args.save_dir,
                "max_nonfinite_steps": 3,
            },
        },
    )
    if (Path(args.save_dir) / "latest").exists():
        engine.load_checkpoint(args.save_dir)
    nan_steps = {int(s) for s in args.nan_steps.split(",") if s}
    poison = {"on": False}
    engine.module.lm_head.register_forward_hook(lambda m, i, out: out * float("nan") if poison["on"] else out)
    for step in range(engine.global_steps, args.steps):
        if step == args.skip_step and rank == 1:
            continue
        poison["on"] = rank == 1 and step in nan_steps
        x, y = batch(step, rank)
        engine.backward(engine(x, y))
        engine.step()
        if engine.global_steps % 2 == 0:
            engine.save_checkpoint(args.save_dir)
    if rank == 0:
        print(f"FINISHED at step {engine.global_steps}, skipped {engine.skipped_steps}", flush=True)
    dist.barrier()


if __name__ == "__main__":
    sys.exit(main())
