"""ALST's loop on a Hugging Face Llama (tools/alst_script.py, sp 2 on 2 gloo ranks) under real
DeepSpeed or under zerotron through the `deepspeed` alias, against one process training the same
samples whole: per-step losses, the largest relative loss and weight differences, as JSON.

    torchrun --standalone --nproc_per_node 2 tools/alst_compare.py STAGE sgd|adamw [TILED_SHARDS]

Run it with DeepSpeed's interpreter for DeepSpeed, and with ZEROTRON_AS_DEEPSPEED=1 for zerotron.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("DS_ACCELERATOR", "cpu")


def main(stage: int, kind: str, tiled: int, steps: int = 6, sp: int = 2):
    import deepspeed
    from deepspeed.runtime.sequence_parallel import ulysses_sp

    deepspeed.init_distributed(dist_backend="gloo")
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from tools import alst_script as script

    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]  # registering wraps it: the one-process reference needs it back
    losses, weights, _ = script.train(deepspeed, ulysses_sp, stage, sp, steps, kind, tiled, script.EVEN)
    ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa
    world = dist.get_world_size()
    want_losses, want = script.reference(script.samples(steps * world, script.EVEN), world // sp, sp, steps, kind)
    if dist.get_rank() == 0:
        print(
            json.dumps(
                {
                    "system": "zerotron" if hasattr(deepspeed, "Config") else f"deepspeed {deepspeed.__version__}",
                    "stage": stage,
                    "optimizer": kind,
                    "tiled_mlp_shards": tiled,
                    "losses": losses,
                    "max_loss_rel_diff": script.max_loss_rel(losses, want_losses),
                    "max_weight_diff": script.max_weight_diff(weights, want),
                }
            )
        )


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 0)
