"""Checkpoints written by real DeepSpeed, and DeepSpeed's own resume of them, as test fixtures.

tests/test_checkpoint_deepspeed.py checks that zerotron resumes DeepSpeed's directories exactly as
DeepSpeed does. DeepSpeed is no test dependency, so this script, run once with DeepSpeed's interpreter,
writes them under tests/deepspeed_checkpoints/ (a few hundred parameters: tens of kB each):

    <case>/ckpt/                  DeepSpeed's save_checkpoint (global_step3/, latest), ZeRO 0-3 x fp32/bf16
    <case>/zero_to_fp32.safetensors   DeepSpeed's own zero_to_fp32 of it (stages 1-3)
    universal_<case>/ckpt/        ds_to_universal's conversion of <case>
    golden.json                   per case: the losses of the 3 saved steps, of the next 4 steps run
                                  straight on, and of DeepSpeed's resume of the directory (world 2, and
                                  world 1 for the universal ones), the lr, counters and client state

    DS_ACCELERATOR=cpu torchrun --standalone --nproc_per_node 2 tools/deepspeed_checkpoints.py write [OUT]
    DS_ACCELERATOR=cpu torchrun --standalone --nproc_per_node 1 tools/deepspeed_checkpoints.py universal1 [OUT]
    DS_ACCELERATOR=cpu torchrun --standalone --nproc_per_node N tools/deepspeed_checkpoints.py resume DIR STAGE DTYPE
      (the last: DeepSpeed resuming any directory, e.g. one `zerotron convert --to-deepspeed` wrote; prints
       the next losses as JSON)

The model, data and config below are also what the test trains zerotron with (imported from here).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

SAVE_STEPS = 3  # steps before the save
RESUME_STEPS = 4  # steps after it
MICRO_BATCH = 4  # rows per rank at world 2 (a world of one takes both ranks' rows)
CASES = [(stage, dtype) for stage in (0, 1, 2, 3) for dtype in ("fp32", "bf16")]
UNIVERSAL = [(2, "fp32"), (3, "bf16")]
CLIENT_STATE = {"epoch": 1, "note": "from deepspeed"}
FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "deepspeed_checkpoints"


class Net(torch.nn.Module):
    """Three linear layers and a buffer; forward(x, y) is the mean squared error. 307 parameters: an odd
    count, so DeepSpeed pads its flat partitions (and ZeRO-3 each parameter's) as a real model's."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.fc2 = torch.nn.Linear(16, 8)
        self.head = torch.nn.Linear(8, 3)
        self.register_buffer("shift", torch.linspace(-0.5, 0.5, 3))

    def forward(self, x, y):
        x = x.to(self.fc1.weight.dtype)
        h = torch.tanh(self.fc2(torch.tanh(self.fc1(x))))
        return ((self.head(h).float() + self.shift.float() - y) ** 2).mean()


def case_name(stage: int, dtype: str) -> str:
    return f"zero{stage}_{dtype}"


def make_model(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net()


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Global batch `step` (8 rows), the rows of `rank` of `world` ranks."""
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(2 * MICRO_BATCH, 8, generator=g), torch.randn(2 * MICRO_BATCH, 3, generator=g)
    rows = slice(rank * len(x) // world, (rank + 1) * len(x) // world)
    return x[rows], y[rows]


def config(stage: int, dtype: str, world: int = 2, universal: bool = False) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 2 * MICRO_BATCH // world,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01, "torch_adam": True}},
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01, "warmup_num_steps": 10},
        },
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": dtype == "bf16"},
        "checkpoint": {"load_universal": universal},
        "steps_per_print": 1000,
    }


def train(engine, steps: int) -> list[list[float]]:
    """Each step's loss on every rank: [[rank 0, rank 1, ...], ...]."""
    import torch.distributed as dist

    losses = []
    for _ in range(steps):
        x, y = batch(engine.global_steps, dist.get_rank(), dist.get_world_size())
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, loss.item())
        losses.append(everyone)
    return losses


def _engine(stage: int, dtype: str, seed: int, universal: bool = False):
    import deepspeed
    import torch.distributed as dist

    world = dist.get_world_size()
    engine, *_ = deepspeed.initialize(model=make_model(seed), config=config(stage, dtype, world, universal))
    return engine


def _resume(directory, stage: int, dtype: str, universal: bool = False) -> dict:
    engine = _engine(stage, dtype, seed=7, universal=universal)  # other initial weights: the load must replace them
    _, client = engine.load_checkpoint(str(directory))
    return {
        "global_steps": engine.global_steps,
        "lr": engine.get_lr()[0],
        "client_state": {k: client[k] for k in CLIENT_STATE} if client else None,
        "losses": train(engine, RESUME_STEPS),
    }


def write(out: Path):
    import deepspeed
    import torch.distributed as dist

    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    golden = {}
    for stage, dtype in CASES:
        name = case_name(stage, dtype)
        ckpt = out / name / "ckpt"
        if rank == 0:
            shutil.rmtree(out / name, ignore_errors=True)
        dist.barrier()
        engine = _engine(stage, dtype, seed=0)
        saved = train(engine, SAVE_STEPS)
        engine.save_checkpoint(str(ckpt), client_state=CLIENT_STATE)
        straight = train(engine, RESUME_STEPS)
        golden[name] = {"saved": saved, "straight": straight, "resumed": _resume(ckpt, stage, dtype)}
        if rank == 0:
            for script in ("zero_to_fp32.py", "zero_to_torch.py"):  # DeepSpeed's scripts, copied in by its save
                (ckpt / script).unlink(missing_ok=True)
            if stage > 0:
                from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
                from safetensors.torch import save_file

                state = get_fp32_state_dict_from_zero_checkpoint(str(ckpt))
                save_file({k: v.contiguous() for k, v in state.items()}, str(out / name / "zero_to_fp32.safetensors"))
        dist.barrier()
    for stage, dtype in UNIVERSAL:
        name = "universal_" + case_name(stage, dtype)
        ckpt = out / name / "ckpt"
        if rank == 0:
            to_universal(out / case_name(stage, dtype) / "ckpt", ckpt)
        dist.barrier()
        golden[name] = {"resumed": _resume(ckpt, stage, dtype, universal=True)}
    if rank == 0:
        (out / "golden.json").write_text(json.dumps(golden, indent=1) + "\n")


def to_universal(ckpt: Path, out: Path):
    """DeepSpeed's ds_to_universal of ckpt's latest tag into out/<tag>_universal, with out/latest."""
    tag = (ckpt / "latest").read_text().strip()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(ckpt / tag)]
    cmd += ["--output_folder", str(out / f"{tag}_universal"), "--num_extract_workers", "1", "--num_merge_workers", "1"]
    cmd.append("--inject_missing_state")  # (the universal-checkpoint marker only Megatron-DeepSpeed writes itself)
    subprocess.run(cmd, check=True, env={**os.environ, "RANK": "0", "WORLD_SIZE": "1"})
    (out / "latest").write_text(f"{tag}_universal")


def universal_world1(out: Path):
    """DeepSpeed's resume of each universal checkpoint on one rank, added to golden.json."""
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    golden = json.loads((out / "golden.json").read_text())
    for stage, dtype in UNIVERSAL:
        name = "universal_" + case_name(stage, dtype)
        golden[name]["resumed_world1"] = _resume(out / name / "ckpt", stage, dtype, universal=True)
    (out / "golden.json").write_text(json.dumps(golden, indent=1) + "\n")


def resume(directory: str, stage: int, dtype: str):
    import deepspeed
    import torch.distributed as dist

    deepspeed.init_distributed(dist_backend="gloo")
    result = _resume(Path(directory), stage, dtype)
    if dist.get_rank() == 0:
        print(json.dumps(result))


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    what, args = sys.argv[1], sys.argv[2:]
    if what == "write":
        write(Path(args[0]) if args else FIXTURES)
    elif what == "universal1":
        universal_world1(Path(args[0]) if args else FIXTURES)
    elif what == "resume":
        resume(args[0], int(args[1]), args[2])
    else:
        sys.exit(f"unknown command {what!r}: write, universal1 or resume")
