"""Rows grouped by expert times each expert's weight: torch's grouped matrix multiply where the build
has it for these tensors (one kernel for every expert), a loop over the experts otherwise.

How the rows are grouped is `Groups`: each expert's row count on the host (split sizes, the loop) and the
kernel's offsets on the device (cumulative counts, int32). Whoever groups the rows makes both, from one
host read of the counts per layer (moe/exchange.py), so no matrix multiply waits for the device."""

from __future__ import annotations

from typing import NamedTuple

import torch


class Groups(NamedTuple):
    counts: list[int]  # rows of each expert, in order
    offsets: torch.Tensor | None  # their running sum as int32 on the rows' device (None: made from counts)


def on_device(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on `device`: through page-locked memory on a GPU, so the copy is asynchronous
    (from pageable memory the driver may make the host wait)."""
    return values.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else values.to(device)


def groups_of(counts: list[int], device: torch.device) -> Groups:
    """Groups from host counts alone (the offsets copied to the device once)."""
    return Groups(counts, on_device(torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32), device))


def grouped_linear(rows: torch.Tensor, weight: torch.Tensor, groups: Groups | list[int]) -> torch.Tensor:
    """rows [n, in] holding `counts[e]` rows for expert e in order, weight [experts, out, in] ->
    [n, out], each expert's rows through its own weight (as F.linear)."""
    if not isinstance(groups, Groups):
        groups = Groups(list(groups), None)
    if _grouped_mm_fits(rows, weight):
        offsets = groups.offsets if groups.offsets is not None else groups_of(groups.counts, rows.device).offsets
        out = torch._grouped_mm(rows, weight.transpose(-2, -1), offs=offsets)
        if out.requires_grad:  # its backward needs a dense incoming gradient (a sum's is expanded)
            out.register_hook(lambda grad: grad.contiguous())
        return out
    parts = [r @ w.t() for r, w in zip(rows.split(groups.counts), weight)]
    return torch.cat(parts) if parts else rows.new_zeros(0, weight.shape[1])


def _grouped_mm_fits(rows: torch.Tensor, weight: torch.Tensor) -> bool:
    """The kernel exists (torch 2.8+) for this device and dtype: on CPU any float, on CUDA bf16;
    every row and column 16-byte aligned (ZeRO's buckets start each parameter on a 16-byte boundary:
    zero/flat.py)."""
    if not hasattr(torch, "_grouped_mm") or rows.dtype != weight.dtype or rows.dim() != 2:
        return False
    if rows.device.type == "cuda":
        if rows.dtype != torch.bfloat16:
            return False
    elif rows.device.type != "cpu":
        return False
    per_16_bytes = 16 // rows.element_size()
    return all(d % per_16_bytes == 0 for d in (rows.shape[1], weight.shape[1], weight.shape[2]))
