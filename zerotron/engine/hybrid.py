"""DeepSpeed's RLHF hybrid engine (`"hybrid_engine": {"enabled": true}`, DeepSpeed-Chat's actor), as
far as it changes what a script computes.

DeepSpeed's hybrid engine is its ordinary engine for training; for generation it swaps the model's
transformer layers for inference kernels while the engine is in eval(), and it gives every rank
rank 0's random state when it is built. Where DeepSpeed has no kernel for the model (on CPU, and for
Transformers' current decoder layers) it generates with the model's own generate(), and so does
zerotron always: generation runs the training model, whose ZeRO-3 units are gathered as in any
forward. What is left to do here is the random state, so that sampled generations (do_sample) draw
the same numbers on every rank as they do under DeepSpeed. The section's other keys tune the kernels
(speed and memory only); config/deepspeed.py names them when it reads the section.
"""

from __future__ import annotations

import torch

from ..comm import comm_for, local_device
from ..config.sections import enabled


def hybrid_engine_enabled(raw: dict) -> bool:
    return enabled(raw.get("hybrid_engine"))


def sync_generation_rng() -> None:
    """Every rank takes rank 0's state of the generator its device samples from (the GPU's on
    CUDA, the CPU's otherwise), over all ranks, as DeepSpeed's hybrid engine does once when built;
    the other generator is left alone, as there."""
    device = local_device()
    cuda = device.type == "cuda"
    state = torch.cuda.get_rng_state().to(device) if cuda else torch.get_rng_state()
    comm_for(None, "world").broadcast(state, src_group_rank=0)
    if cuda:
        torch.cuda.set_rng_state(state.cpu())
    else:
        torch.set_rng_state(state)
