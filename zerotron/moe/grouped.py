"""Rows grouped by expert times each expert's weight: torch's grouped matrix multiply where the build
has it for these tensors (one kernel for every expert), a loop over the experts otherwise."""

from __future__ import annotations

import torch


def grouped_linear(rows: torch.Tensor, weight: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """rows [n, in] holding `counts[e]` rows for expert e in order, weight [experts, out, in] ->
    [n, out], each expert's rows through its own weight (as F.linear)."""
    if _grouped_mm_fits(rows, weight):
        offsets = torch.tensor(counts, device=rows.device).cumsum(0).to(torch.int32)
        out = torch._grouped_mm(rows, weight.transpose(-2, -1), offs=offsets)
        if out.requires_grad:  # its backward needs a dense incoming gradient (a sum's is expanded)
            out.register_hook(lambda grad: grad.contiguous())
        return out
    parts = [r @ w.t() for r, w in zip(rows.split(counts), weight)]
    return torch.cat(parts) if parts else rows.new_zeros(0, weight.shape[1])


def _grouped_mm_fits(rows: torch.Tensor, weight: torch.Tensor) -> bool:
    """The kernel exists (torch 2.8+) for this device and dtype: on CPU any float, on CUDA bf16;
    every row and column 16-byte aligned."""
    if not hasattr(torch, "_grouped_mm") or rows.dtype != weight.dtype or rows.dim() != 2:
        return False
    if rows.device.type == "cuda":
        if rows.dtype != torch.bfloat16:
            return False
    elif rows.device.type != "cpu":
        return False
    per_16_bytes = 16 // rows.element_size()
    return all(d % per_16_bytes == 0 for d in (rows.shape[1], weight.shape[1], weight.shape[2]))
