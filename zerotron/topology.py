"""Which rank does what: data x tensor x pipeline parallel sizes, coordinates and groups.

Ranks are laid out pipeline-outermost and tensor-innermost (rank = (pp * dp + dp_idx) * tp + tp_idx),
so the chattiest group, tensor parallel, is made of neighbouring ranks on one node.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist

from .comm import cached_groups
from .errors import ConfigError
from .timeouts import group_timeout

DIMS = ("pp", "dp", "tp")


@dataclass(frozen=True)
class Coords:
    pp: int
    dp: int
    tp: int


class Topology:
    """Sizes and coordinates are pure arithmetic; `build_groups()` makes the process groups."""

    def __init__(self, world_size: int, tp: int = 1, pp: int = 1):
        for name, size in (("world size", world_size), ("tensor-parallel size", tp), ("pipeline-parallel size", pp)):
            if size < 1:
                raise ConfigError(name, size, "must be a positive integer")
        if world_size % (tp * pp):
            raise ConfigError(
                "tensor_parallel.autotp_size",
                tp,
                f"tensor ({tp}) x pipeline ({pp}) parallel size must divide the world size "
                f"({world_size}); change the sizes or the number of processes",
            )
        self.world_size, self.tp, self.pp = world_size, tp, pp
        self.dp = world_size // (tp * pp)
        self._groups: dict[str, Optional[dist.ProcessGroup]] = {}

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.pp, self.dp, self.tp)

    def coords(self, rank: int) -> Coords:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the world of {self.world_size} ranks")
        return Coords(pp=rank // (self.dp * self.tp), dp=(rank // self.tp) % self.dp, tp=rank % self.tp)

    def rank_of(self, pp: int, dp: int, tp: int) -> int:
        return (pp * self.dp + dp) * self.tp + tp

    def group_ranks(self, dim: str, rank: int) -> list[int]:
        """The ranks that share every coordinate with `rank` except `dim`, in order along `dim`."""
        c = self.coords(rank)
        size = {"pp": self.pp, "dp": self.dp, "tp": self.tp}[dim]
        return [self.rank_of(**{**c.__dict__, dim: i}) for i in range(size)]

    def build_groups(self, device_type: str = "cpu") -> "Topology":
        """Create one process group per dimension (and a second data-parallel one, for gradient
        reductions: see zero/sharded.py), with the timeout `init_distributed` was given. A second
        engine of the same layout (a reference model beside the trained one, the next model of a
        sweep) reuses them: each process group costs connections and threads."""
        if dist.get_world_size() != self.world_size:
            raise RuntimeError(
                f"topology was made for {self.world_size} ranks but the process group has {dist.get_world_size()}"
            )
        self._groups = cached_groups(("groups", self.shape), self._make_groups)
        return self

    def _make_groups(self) -> dict:
        groups = {}
        for dim in DIMS + ("dp_grad",):
            along = "dp" if dim == "dp_grad" else dim
            # every rank creates every group of the dimension, in one order
            slices = sorted({tuple(self.group_ranks(along, r)) for r in range(self.world_size)})
            mine, _ = dist.new_subgroups_by_enumeration([list(s) for s in slices], timeout=group_timeout())
            groups[dim] = mine
        return groups

    def group(self, dim: str) -> dist.ProcessGroup:
        if dim not in self._groups:
            raise RuntimeError("call Topology.build_groups() before asking for process groups")
        return self._groups[dim]

    def __repr__(self):
        return f"Topology(world={self.world_size}, pp={self.pp}, dp={self.dp}, tp={self.tp})"
