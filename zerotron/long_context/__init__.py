"""Long context: a sequence split over ranks. Ulysses (ulysses.py): attention's inputs re-split from
sequence to heads by an all-to-all, so each rank attends over the whole sequence for its heads
(DeepSpeed's `deepspeed.sequence.layer.DistributedAttention`); mpu.py: DeepSpeed's sequence-parallel
mpu; model.py: Ulysses applied to the reference GPT. For Hugging Face models (ALST):
hf_attention.py (Transformers' attention function under Ulysses), hf_batches.py (batches split
along the sequence), tiled.py (MLP, loss and any per-token compute one slice at a time)."""

from .hf_batches import shard_batch
from .ulysses import DistributedAttention, seq_all_to_all

__all__ = ["DistributedAttention", "seq_all_to_all", "shard_batch"]
