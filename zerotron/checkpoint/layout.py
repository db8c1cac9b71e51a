"""What a rank's share of the training state is, in topology-free terms.

Every trainable parameter has a full name and a full shape. A rank holds, for some parameters, a
*piece*: with tensor parallelism the parameter is first cut along `tp_dim` into `tp_size` local
tensors (the rank's is number `tp_rank`), and ZeRO then gives the rank the flat range [lo, hi) of
that local tensor. The fp32 master and each optimizer state tensor of the piece are stored under
the piece's description; any other topology finds what it needs by the same arithmetic.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from ..moe.expert_groups import global_expert_names
from ..tensor_parallel.split import join_parts, local_part


@dataclass(frozen=True)
class Piece:
    name: str  # full parameter name in the module
    shape: tuple  # full shape (all tensor-parallel pieces together)
    tp_dim: int  # -1: not split by tensor parallelism
    tp_rank: int
    tp_size: int
    lo: int  # flat range of the tensor-parallel local tensor
    hi: int
    tp_stride: int = 1  # a fused projection split block by block (parallel/split.py)

    def to_json(self) -> dict:
        return {**asdict(self), "shape": list(self.shape)}

    @classmethod
    def from_json(cls, d: dict) -> "Piece":
        return cls(**{**d, "shape": tuple(d["shape"])})

    @property
    def local_shape(self) -> tuple:
        if self.tp_dim < 0:
            return self.shape
        shape = list(self.shape)
        shape[self.tp_dim] //= self.tp_size
        return tuple(shape)


def tensor_parallel_of(param) -> tuple[int, int, int]:
    """(dim, rank, size) of a parameter's tensor-parallel split; (-1, 0, 1) when it is whole."""
    if not hasattr(param, "tp_split_dim"):
        return -1, 0, 1
    return param.tp_split_dim, param.tp_comm.rank, param.tp_comm.size


def stride_of(param) -> int:
    return getattr(param, "tp_stride", 1)


def full_shape(param) -> tuple:
    dim, _, size = tensor_parallel_of(param)
    shape = list(getattr(param, "ds_shape", param.shape))  # (a released ZeRO-3 parameter reads as empty)
    if dim >= 0:
        shape[dim] *= size
    return tuple(shape)


def rank_pieces(engine):
    """(Piece, parameter, master tensor, offset in it) for every trainable-parameter piece this rank stores."""
    names = {}
    source = getattr(engine.module, "source_names", {})  # a pipeline of an existing model: its names
    if engine.topology.ep > 1:  # experts by their global number
        source = global_expert_names(engine.module, engine.coords.dp % engine.topology.ep)
    for name, p in engine.module.named_parameters():
        names.setdefault(id(p), source.get(name, name))
    for param, start, length, master, offset in engine.states.pieces():
        dim, rank, size = tensor_parallel_of(param)
        yield (
            Piece(names[id(param)], full_shape(param), dim, rank, size, start, start + length, stride_of(param)),
            param,
            master,
            offset,
        )


def assemble(pieces: list[tuple[Piece, torch.Tensor]], name: str) -> torch.Tensor:
    """The full tensor from pieces that together cover it (duplicates allowed)."""
    first = pieces[0][0]
    locals_: dict[int, torch.Tensor] = {}
    covered: dict[int, torch.Tensor] = {}
    numel = 1
    for n in first.local_shape:
        numel *= n
    for piece, values in pieces:
        r = piece.tp_rank if piece.tp_dim >= 0 else 0
        if r not in locals_:
            locals_[r] = torch.empty(numel, dtype=values.dtype)
            covered[r] = torch.zeros(numel, dtype=torch.bool)
        locals_[r][piece.lo : piece.hi] = values.reshape(-1)
        covered[r][piece.lo : piece.hi] = True
    ranks = range(first.tp_size) if first.tp_dim >= 0 else [0]
    for r in ranks:
        if r not in covered or not bool(covered[r].all()):
            raise ValueError(
                f"the checkpoint does not hold all of parameter {name!r} (tensor-parallel piece {r}); "
                "a shard file is missing or the checkpoint is incomplete"
            )
    if first.tp_dim < 0:
        return locals_[0].view(first.shape)
    return join_parts([locals_[r].view(first.local_shape) for r in ranks], first.tp_dim, first.tp_stride)


def my_slice(full: torch.Tensor, param, start: int, length: int) -> torch.Tensor:
    """This rank's [start, start + length) of its tensor-parallel local part of `full`."""
    dim, rank, size = tensor_parallel_of(param)
    local = full if dim < 0 else local_part(full, dim, rank, size, stride_of(param))
    return local.reshape(-1)[start : start + length]
