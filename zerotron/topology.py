"""Which rank does what: pipeline x data x context x sequence x tensor parallel sizes, coordinates
and groups.

Ranks are laid out pipeline-outermost and tensor-innermost (rank = (((pp * dp + dp_idx) * cp +
cp_idx) * sp + sp_idx) * tp + tp_idx), so the chattiest groups, tensor and then Ulysses' all-to-all,
are made of neighbouring ranks on one node (with tp 1 the Ulysses groups are DeepSpeed's:
consecutive ranks). A sequence is split over its cp x sp sequence ranks ("seq"): ring attention
passes key/value blocks around the cp ranks ("cp"), Ulysses trades sequence for heads within the sp
ranks ("sp"); with one of them 1, "seq" is the other's group.

The ranks that hold the same parameters are the data x sequence ranks of one (pp, tp) place: ZeRO
shards over them and gradients are reduced over them ("dp" and "dp_grad"; DeepSpeed's sequence-data-
parallel group). The data sampler splits samples over the data ranks only ("data"): the sequence
ranks of one data rank read the same samples, each its part of the sequence.

Expert parallelism splits the data ranks further, as DeepSpeed does: runs of `ep` consecutive data
ranks trade tokens and hold one expert each of every `ep` ("ep"); the data ranks with the same place
in their run hold the same experts ("edp", and "edp_grad" for the experts' gradient reductions).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist

from .comm import cached_groups
from .errors import ConfigError
from .timeouts import group_timeout

DIMS = ("pp", "dp", "cp", "sp", "tp")


@dataclass(frozen=True)
class Coords:
    pp: int
    dp: int
    sp: int
    tp: int
    cp: int = 0


class Topology:
    """Sizes and coordinates are pure arithmetic; `build_groups()` makes the process groups."""

    def __init__(self, world_size: int, tp: int = 1, pp: int = 1, sp: int = 1, cp: int = 1, ep: int = 1):
        sizes = (
            ("world size", world_size),
            ("tensor-parallel size", tp),
            ("pipeline-parallel size", pp),
            ("sequence_parallel_size", sp),
            ("zerotron.context_parallel_size", cp),
        )
        for name, size in sizes:
            if size < 1:
                raise ConfigError(name, size, "must be a positive integer")
        if world_size % (tp * pp * sp * cp):
            key, value = next(
                ((k, v) for k, v in (("sequence_parallel_size", sp), ("zerotron.context_parallel_size", cp)) if v > 1),
                ("tensor_parallel.autotp_size", tp),
            )
            raise ConfigError(
                key,
                value,
                f"tensor ({tp}) x pipeline ({pp}) x sequence ({sp}) x context ({cp}) parallel size must divide the "
                f"world size ({world_size}); change the sizes or the number of processes",
            )
        self.world_size, self.tp, self.pp, self.sp, self.cp = world_size, tp, pp, sp, cp
        self.dp = world_size // (tp * pp * sp * cp)
        self.ep = ep
        if ep > 1 and (self.dp % ep or tp * pp * sp * cp > 1):
            raise ConfigError(
                "expert-parallel size (MoE ep_size / expert_parallel.autoep_size)",
                ep,
                f"must divide the data-parallel size ({self.dp}) of a data-parallel layout: expert parallelism "
                "composes with data parallelism and every ZeRO stage, not yet with tensor, pipeline or sequence "
                "parallelism; change ep_size or the other sizes",
            )
        self._groups: dict[str, Optional[dist.ProcessGroup]] = {}

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.pp, self.dp, self.cp, self.sp, self.tp)

    @property
    def seq(self) -> int:
        """How many ranks split each sequence (ring x Ulysses)."""
        return self.cp * self.sp

    @property
    def replicas(self) -> int:
        """How many ranks hold the same parameters (ZeRO's and the gradient reduction's group size)."""
        return self.dp * self.seq

    @property
    def edp(self) -> int:
        """How many ranks hold the same experts (DeepSpeed's expert-data-parallel size)."""
        return self.dp // self.ep

    def coords(self, rank: int) -> Coords:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the world of {self.world_size} ranks")
        return Coords(
            pp=rank // (self.dp * self.seq * self.tp),
            dp=(rank // (self.seq * self.tp)) % self.dp,
            sp=(rank // self.tp) % self.sp,
            tp=rank % self.tp,
            cp=(rank // (self.sp * self.tp)) % self.cp,
        )

    def rank_of(self, pp: int, dp: int, tp: int, sp: int = 0, cp: int = 0) -> int:
        return (((pp * self.dp + dp) * self.cp + cp) * self.sp + sp) * self.tp + tp

    def group_ranks(self, dim: str, rank: int) -> list[int]:
        """The ranks that share every coordinate with `rank` except `dim` ("seq": except cp and sp;
        "replicas": except dp, cp and sp), in order along `dim`."""
        c = self.coords(rank)
        if dim in ("ep", "edp"):
            run, place = divmod(c.dp, self.ep)
            data = [run * self.ep + i for i in range(self.ep)] if dim == "ep" else range(place, self.dp, self.ep)
            return [self.rank_of(c.pp, d, c.tp, c.sp, c.cp) for d in data]
        if dim in ("seq", "replicas"):
            data = range(self.dp) if dim == "replicas" else [c.dp]
            return [self.rank_of(c.pp, d, c.tp, s, r) for d in data for r in range(self.cp) for s in range(self.sp)]
        size = {"pp": self.pp, "dp": self.dp, "cp": self.cp, "sp": self.sp, "tp": self.tp}[dim]
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
        self._groups = cached_groups(("groups", self.shape, self.ep), self._make_groups)
        return self

    # The engine's groups: "dp" (ZeRO, parameter gathers, the start-up broadcast) and "dp_grad"
    # (gradient reductions: see zero/sharded.py) span every replica, data and sequence ranks alike;
    # "data" is the data ranks alone (samples), "sp" the sequence ranks (attention's all-to-all).
    _ALONG = {
        "pp": "pp",
        "dp": "replicas",
        "sp": "sp",
        "cp": "cp",
        "seq": "seq",
        "tp": "tp",
        "data": "dp",
        "dp_grad": "replicas",
        "ep": "ep",
        "edp": "edp",
        "edp_grad": "edp",
    }

    def _make_groups(self) -> dict:
        # without a dimension there is no group for it (ask its size); a group with the ranks of
        # another is that group (each process group costs connections and threads)
        same = {"sp": self.sp == 1, "cp": self.cp == 1, "seq": self.cp == 1 or self.sp == 1, "data": self.seq == 1}
        same.update(ep=self.ep == 1, edp=self.ep == 1, edp_grad=self.ep == 1)
        groups = {}
        for name, along in self._ALONG.items():
            if same.get(name):
                continue
            # every rank creates every group of the dimension, in one order
            slices = sorted({tuple(self.group_ranks(along, r)) for r in range(self.world_size)})
            mine, _ = dist.new_subgroups_by_enumeration([list(s) for s in slices], timeout=group_timeout())
            groups[name] = mine
        if self.seq == 1:
            groups["data"] = groups["dp"]
        elif self.cp == 1 or self.sp == 1:
            groups["seq"] = groups["sp" if self.cp == 1 else "cp"]
        return groups

    def group(self, dim: str) -> dist.ProcessGroup:
        if dim not in self._groups:
            raise RuntimeError("call Topology.build_groups() before asking for process groups")
        return self._groups[dim]

    def __repr__(self):
        sp = f", sp={self.sp}" if self.sp > 1 else ""
        cp = f", cp={self.cp}" if self.cp > 1 else ""
        ep = f", ep={self.ep}" if self.ep > 1 else ""
        return f"Topology(world={self.world_size}, pp={self.pp}, dp={self.dp}{ep}{cp}{sp}, tp={self.tp})"
