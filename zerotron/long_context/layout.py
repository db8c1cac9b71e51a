"""Where a rank's tokens sit in the whole sequence. With ring attention over cp ranks the sequence is
cut into 2*cp chunks and ring rank c holds chunks c and 2*cp-1-c (ring.py: load balancing); with
Ulysses over sp ranks each holds a contiguous 1/sp of that (of the whole sequence when cp is 1),
so Ulysses' all-to-all gathers exactly the ring rank's part, in order."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .ring import ring_shard


@dataclass(frozen=True)
class SequenceSplit:
    sp: int = 1
    sp_index: int = 0
    cp: int = 1
    cp_index: int = 0

    @classmethod
    def of(cls, topology, rank: int) -> "SequenceSplit":
        c = topology.coords(rank)
        return cls(topology.sp, c.sp, topology.cp, c.cp)

    @property
    def parts(self) -> int:
        return self.sp * self.cp

    def multiple(self) -> int:
        """What the sequence length must be a multiple of."""
        return self.sp * (2 * self.cp if self.cp > 1 else 1)

    def take(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of the whole sequence `x` (along `dim`)."""
        if x.shape[dim] % self.multiple():
            raise ValueError(
                f"a sequence of {x.shape[dim]} tokens cannot be split over {self.cp} ring x {self.sp} Ulysses ranks: "
                f"use a length that is a multiple of {self.multiple()}"
            )
        if self.cp > 1:
            x = ring_shard(x, dim, self.cp_index, self.cp)
        return x.chunk(self.sp, dim=dim)[self.sp_index] if self.sp > 1 else x

    def positions(self, local_length: int, device=None) -> tuple[torch.Tensor, int]:
        """The positions in the whole sequence of this rank's `local_length` tokens, and the whole
        sequence's length (every rank's the same: no device value is read to check it)."""
        whole = local_length * self.parts
        return self.take(torch.arange(whole, device=device), dim=0), whole
