"""How a tensor-parallel parameter is cut, in one place (layers, checkpoints and consolidation use it).

A parameter split along `dim` over `size` ranks gives rank r the r-th of `size` equal chunks. A
fused parameter (GPT-2's q|k|v projection) is split with `stride` 3: each of its 3 blocks along
`dim` is cut separately and rank r holds [q_r | k_r | v_r], so its local q/k/v stay contiguous.
"""

from __future__ import annotations

import torch


def local_part(full: torch.Tensor, dim: int, rank: int, size: int, stride: int = 1) -> torch.Tensor:
    if stride == 1:
        return full.chunk(size, dim=dim)[rank]
    return torch.cat([block.chunk(size, dim=dim)[rank] for block in full.chunk(stride, dim=dim)], dim=dim)


def join_parts(parts: list[torch.Tensor], dim: int, stride: int = 1) -> torch.Tensor:
    """The full tensor from every rank's local part, in rank order."""
    if stride == 1:
        return torch.cat(parts, dim=dim)
    blocks = [p.chunk(stride, dim=dim) for p in parts]
    return torch.cat([torch.cat([b[s] for b in blocks], dim=dim) for s in range(stride)], dim=dim)
