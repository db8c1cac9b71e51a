"""DeepSpeed's checkpoint layout: its file names, and where a parameter lies in its flat fp32 partitions.
Read by deepspeed_in.py, written by deepspeed_out.py: one home for the arithmetic both directions need.

ZeRO 1-2 (and the bf16 optimizer): each parameter group is one flat vector, the group's parameters in
order (each followed by its `param_alignment_paddings` entry, 0 unless `parameter_alignment`), padded at
the end to a multiple of 2 x world size and cut into `world` equal partitions, one per data-parallel rank.
ZeRO-3: every parameter is cut on its own into `world` pieces of ceil(numel / world), the last padded;
a rank's flat vector holds its piece of each parameter in order.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from .files import META

MODEL_STATES = "mp_rank_00_model_states.pt"
UNIVERSAL_DIR = "zero"
LATEST_UNIVERSAL = "latest_universal"
# What DeepSpeed's save_checkpoint writes into the model-states dict itself; a client's state is the rest.
DEEPSPEED_KEYS = frozenset(
    ("module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params")
    + ("frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names")
    + ("skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config")
    + ("ds_version", "checkpoint_parallel_dimensions", "universal_checkpoint_info")
)
# Torch optimizer settings that choose an implementation, not the math: a resuming optimizer keeps its own.
IMPLEMENTATION_KEYS = ("params", "foreach", "fused", "capturable", "differentiable")


def zero3_model_states(rank: int) -> str:
    return f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"


def optim_states(rank: int, bf16: bool) -> str:
    return f"{'bf16_' if bf16 else ''}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def dp_rank_of(path: Path) -> int:
    return int(re.search(r"zero_pp_rank_(\d+)_", path.name).group(1))


def is_deepspeed(directory: Path) -> bool:
    """A checkpoint DeepSpeed wrote (save_checkpoint or ds_to_universal): model-states files, no meta.json."""
    return not (directory / META).exists() and any(directory.glob("*mp_rank_*_model_states.pt"))


def group_offsets(numels: list[int], alignment_paddings: list[int] | None = None) -> tuple[list[int], int]:
    """ZeRO 1-2: each parameter's offset in its group's flat vector, and the vector's length with padding
    for `world` = 1 (callers pad further with padded_group_numel)."""
    offsets, offset = [], 0
    for i, n in enumerate(numels):
        offsets.append(offset)
        offset += n + (alignment_paddings[i] if alignment_paddings else 0)
    return offsets, offset


def padded_group_numel(numel: int, world: int) -> int:
    """ZeRO 1-2: the flat group's length: a multiple of 2 x world (DeepSpeed's NCCL start alignment)."""
    align = 2 * world
    return math.ceil(numel / align) * align


def zero3_piece_numel(numel: int, world: int) -> int:
    """ZeRO-3: each rank's piece of one parameter (the last rank's padded)."""
    return math.ceil(numel / world)
