"""Batches for Ulysses on Hugging Face models (DeepSpeed's `UlyssesSPDataLoaderAdapter`): the
sequence ranks process one data-loader batch together, each holding a contiguous 1/sp of every
sequence. Labels are shifted before the split (`shift_labels`: token i's target is token i+1, which
may sit on the next rank), so each slice scores its own tokens.

With ring attention the parts are the load-balanced halves of layout.py (`shard_batch`'s cp_rank /
cp_size); the adapter, DeepSpeed's, splits for Ulysses alone.

Each batch the wrapped loader gives a sequence rank is shared with the others, so sp batches come
out per sp batches in, in rank order: the same samples as data parallelism over those ranks, one
at a time. A sequence length that is not a multiple of sp is padded at the end (ids 0, labels
-100, positions counting on, attention mask 0); under causal attention no real token sees the
padding, so the loss and gradients are those of the unpadded batch. Batches without
`position_ids` get 0..n-1 per sequence, what the model would use without sequence parallelism.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..comm import comm_for
from .layout import SequenceSplit


def _padded(batch: dict, multiple: int) -> dict:
    length = batch["input_ids"].shape[1]
    pad = -length % multiple
    if pad == 0:
        return batch
    out = {}
    for key, value in batch.items():
        if not torch.is_tensor(value):
            out[key] = value
        elif key == "position_ids":
            tail = value[:, -1:] + torch.arange(1, pad + 1, dtype=value.dtype, device=value.device)
            out[key] = torch.cat([value, tail], dim=1)
        else:
            fill = -100 if key in ("labels", "shift_labels") else 0
            out[key] = F.pad(value, (0, 0) * (value.dim() - 2) + (0, pad), value=fill)
    return out


def shard_batch(batch: dict, sp_rank: int, sp_size: int, cp_rank: int = 0, cp_size: int = 1) -> dict:
    """This rank's part of one Hugging Face batch: [batch, seq, ...] tensors cut along seq after
    `labels` became `shift_labels` (and padding to a multiple of what the split needs); other values
    kept whole. With ring attention (`cp_size` > 1) the part is load-balanced (layout.py)."""
    if "input_ids" not in batch:
        raise ValueError("a Ulysses batch needs input_ids ([batch, seq] token ids) to find the sequence length")
    batch = dict(batch)
    length = batch["input_ids"].shape[1]
    for key, value in batch.items():
        if torch.is_tensor(value) and (value.dim() < 2 or value.shape[1] != length):
            raise ValueError(
                f"batch[{key!r}] has shape {tuple(value.shape)}: every tensor of a Ulysses batch is split along the "
                f"sequence (dim 1, {length} like input_ids); pass other values as non-tensors or leave them out"
            )
    if "position_ids" not in batch:
        batch["position_ids"] = torch.arange(length, device=batch["input_ids"].device).expand_as(batch["input_ids"])
    if "labels" in batch:
        batch["shift_labels"] = F.pad(batch.pop("labels"), (0, 1), value=-100)[:, 1:].contiguous()
    split = SequenceSplit(sp_size, sp_rank, cp_size, cp_rank)
    batch = _padded(batch, split.multiple())
    return {k: split.take(v).contiguous() if torch.is_tensor(v) else v for k, v in batch.items()}


class UlyssesSPDataLoaderAdapter:
    """DeepSpeed's `UlyssesSPDataLoaderAdapter(dl, sp_rank, sp_group, sp_world_size, device)`: iterate
    it instead of `dl`; `len()` is sp times the wrapped loader's. Batches are dicts of [batch, seq]
    tensors with at least `input_ids` (and `labels` to train on)."""

    def __init__(self, dl, sp_rank: int, sp_group, sp_world_size: int, device):
        self.dl, self.sp_rank, self.sp_group, self.sp_world_size = dl, sp_rank, sp_group, sp_world_size
        self.device = device
        self.comm = comm_for(sp_group, "sp")
        if self.comm.size != sp_world_size or self.comm.rank != sp_rank:
            raise ValueError(
                f"sp_rank {sp_rank} / sp_world_size {sp_world_size} do not match the sequence group (rank "
                f"{self.comm.rank} of {self.comm.size}): pass the mpu's get_sequence_parallel_rank() and _world_size()"
            )

    def __len__(self) -> int:
        return len(self.dl) * self.sp_world_size

    def __iter__(self):
        for batch in self.dl:
            on_host = {k: v.cpu() if torch.is_tensor(v) else v for k, v in batch.items()}
            for shared in self.comm.all_gather_object(on_host):  # one batch per sequence rank, in rank order
                piece = shard_batch(shared, self.sp_rank, self.sp_world_size)
                yield {k: v.to(self.device, non_blocking=True) if torch.is_tensor(v) else v for k, v in piece.items()}

    def set_epoch(self, epoch: int) -> None:
        """Passed on, so a shuffling sampler reshuffles each epoch as it would without the adapter."""
        for owner in (self.dl, getattr(self.dl, "sampler", None), getattr(self.dl, "batch_sampler", None)):
            if hasattr(owner, "set_epoch"):
                owner.set_epoch(epoch)
                return
