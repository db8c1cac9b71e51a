"""Long context: a sequence split over ranks. Ulysses (ulysses.py): attention's inputs re-split from
sequence to heads by an all-to-all, so each rank attends over the whole sequence for its heads
(DeepSpeed's `deepspeed.sequence.layer.DistributedAttention`)."""

from .ulysses import DistributedAttention, seq_all_to_all

__all__ = ["DistributedAttention", "seq_all_to_all"]
