"""`deepspeed.runtime.pipe.topology`: named Cartesian process grids (pure arithmetic).

ProcessTopology(axes, dims) lays ranks out row-major over `axes` (the last axis varies fastest).
PipeModelDataParallelTopology(num_pp, num_mp, num_dp) has axes pipe, data, model: zerotron's own
layout (zerotron/topology.py: pipeline outermost, tensor innermost), so the ranks it names are
the ranks zerotron puts there when the config's tensor_parallel.autotp_size is num_mp and the
PipelineModule has num_pp stages. A PipelineModule takes such a topology for its stage count.
"""

from __future__ import annotations

import itertools
from collections import namedtuple


class ProcessTopology:
    def __init__(self, axes, dims):
        if len(axes) != len(dims):
            raise ValueError(f"axes {axes} and dims {dims} must have the same length")
        if any(int(d) < 1 for d in dims):
            raise ValueError(f"every dimension must be positive, got {dims}")
        self.axes, self.dims = list(axes), [int(d) for d in dims]
        self.ProcessCoord = namedtuple("ProcessCoord", self.axes)
        self.mapping = {
            self.ProcessCoord(*coord): rank
            for rank, coord in enumerate(itertools.product(*(range(d) for d in self.dims)))
        }
        self._coords = {rank: coord for coord, rank in self.mapping.items()}

    def get_rank(self, **coord_kwargs) -> int:
        """The global rank at these coordinates (every axis must be given)."""
        if len(coord_kwargs) != len(self.axes):
            raise ValueError("get_rank() needs a coordinate for every axis; use filter_match() for slices")
        key = self.ProcessCoord(**coord_kwargs)
        if key not in self.mapping:
            raise ValueError(f"coordinates {coord_kwargs} are outside the topology {dict(zip(self.axes, self.dims))}")
        return self.mapping[key]

    def get_axis_names(self) -> list[str]:
        return self.axes

    def get_rank_repr(self, rank, omit_axes=("data", "pipe"), inner_sep="_", outer_sep="-") -> str:
        """e.g. 'model_01' for rank 1 of a pipe x data x model grid (the axes not omitted)."""
        coord = self.get_coord(rank)
        return outer_sep.join(
            f"{axis}{inner_sep}{getattr(coord, axis):02d}" for axis in self.axes if axis not in set(omit_axes)
        )

    def get_dim(self, axis) -> int:
        """The number of ranks along `axis` (0 for an axis the topology does not have)."""
        return self.dims[self.axes.index(axis)] if axis in self.axes else 0

    def get_coord(self, rank):
        if rank not in self._coords:
            raise ValueError(f"rank {rank} is not in the topology (world size {self.world_size()})")
        return self._coords[rank]

    def get_axis_comm_lists(self, axis) -> list[list[int]]:
        """For every combination of the other axes, the ranks along `axis` in order."""
        if axis not in self.axes:
            return []
        others = [a for a in self.axes if a != axis]
        lists = []
        for values in itertools.product(*(range(self.get_dim(a)) for a in others)):
            fixed = dict(zip(others, values))
            lists.append([self.mapping[self.ProcessCoord(**fixed, **{axis: i})] for i in range(self.get_dim(axis))])
        return lists

    def filter_match(self, **filter_kwargs) -> list[int]:
        """The ranks whose coordinates equal the given ones, in rank order."""
        return [
            rank
            for coord, rank in self.mapping.items()
            if all(getattr(coord, k) == v for k, v in filter_kwargs.items())
        ]

    def get_axis_list(self, axis, idx) -> list[int]:
        """The ranks whose coordinate along `axis` is `idx`."""
        i = self.axes.index(axis)
        return [rank for coord, rank in self.mapping.items() if coord[i] == idx]

    def world_size(self) -> int:
        return len(self.mapping)

    def __str__(self):
        return str(self.mapping)


class PipeDataParallelTopology(ProcessTopology):
    """Pipeline x data parallel (data innermost)."""

    def __init__(self, num_pp, num_dp):
        super().__init__(axes=["pipe", "data"], dims=[num_pp, num_dp])


class PipeModelDataParallelTopology(ProcessTopology):
    """Pipeline x data x model (tensor) parallel, tensor innermost: zerotron's layout."""

    def __init__(self, num_pp, num_mp, num_dp):
        super().__init__(axes=["pipe", "data", "model"], dims=[num_pp, num_dp, num_mp])
