"""`deepspeed.runtime.sequence_parallel` / `.ulysses_sp`: Arctic Long Sequence Training (ALST),
DeepSpeed's Ulysses for Hugging Face models, as accelerate's
`ParallelismConfig(sp_backend="deepspeed")`, the Trainer and TRL reach it. The pieces live in
zerotron/long_context/: the attention (hf_attention.py), the batches (hf_batches.py), the tiled
MLP, loss and compute (tiled.py)."""

from __future__ import annotations

from ..long_context.hf_attention import UlyssesSPAttentionHF
from ..long_context.hf_batches import UlyssesSPDataLoaderAdapter
from ..long_context.tiled import SequenceTiledCompute, TiledFusedLogitsLoss, TiledMLP, sequence_tiled_compute

__all__ = [
    "UlyssesSPAttentionHF",
    "UlyssesSPDataLoaderAdapter",
    "SequenceTiledCompute",
    "sequence_tiled_compute",
    "TiledMLP",
    "TiledFusedLogitsLoss",
]
