"""Where a partitioned bucket's full values are: the one gather/release mechanism of ZeRO.

A `Residency` owns the full buffer of one flat bucket (zero/flat.py) whose parameters are, in
turn, views of that buffer (gathered) or empty placeholders (released: the buffer's storage is
freed). Stage 3's units, stages 1-2's replicated buckets under reshard_after_backward /
overlap_param_gather, and zero.Init's per-parameter pieces all gather and release through it:

    start(source, comm)   all-gather `source` (this rank's part) into the buffer, not waited on
    wait()                the gather is done: the parameters hold the values
    release()             free the buffer's memory; the parameters read as empty placeholders
    pin() / unpin()       while pinned, release() leaves the buffer gathered (GatheredParameters)

Freeing the storage itself (not dropping the tensor) is what returns the memory: autograd may
hold views of the buffer (tensors saved for backward), and the next gather regrows it in place.
A released parameter reads as an empty tensor, as DeepSpeed's do, rather than as a view into
freed storage, which would crash the process when a script reads it.

Code that lets users hold parameters gathered (GatheredParameters, consolidated_state_dict) sees
each parameter's holder through `holder_of(param)`: an object with `order` (the same on every
rank: holders are gathered in that order), `hold()` (gather and pin) and `let_go(modifier_rank)`
(with a rank, that rank's values become everyone's, in the shards and fp32 masters too; then
unpin and release unless something else still holds it).
"""

from __future__ import annotations

import enum

import torch

from .flat import FlatBucket


class State(enum.Enum):
    RELEASED = "released"  # only this rank's part exists; the parameters are placeholders
    GATHERING = "gathering"  # an all-gather is in flight into the buffer
    GATHERED = "gathered"  # the buffer holds every rank's part; the parameters are views of it


class Residency:
    def __init__(self, layout: FlatBucket, full: torch.Tensor, on_change=None):
        """`full`: the bucket's buffer, holding the values, its parameters pointing at it."""
        self.layout, self.full = layout, full
        self.state = State.GATHERED
        self.pins = 0
        self.on_change = on_change  # called with each new State (stage 3: DeepSpeed's ds_status)
        self.placeholder = torch.empty(0, dtype=full.dtype, device=full.device)
        self._work = self._source = None

    @classmethod
    def empty(cls, layout: FlatBucket, dtype: torch.dtype, device, on_change=None) -> "Residency":
        """A released residency whose buffer has no memory yet."""
        r = cls(layout, torch.empty(layout.padded_numel, dtype=dtype, device=device), on_change)
        r.full.untyped_storage().resize_(0)
        r.state = State.RELEASED
        return r

    @property
    def numel(self) -> int:
        return self.layout.padded_numel

    @property
    def released(self) -> bool:
        return self.state is State.RELEASED

    def own_slice(self) -> torch.Tensor:
        """This rank's part of the buffer, to write before gathering in place (regrown if released;
        an earlier gather into it waited on first)."""
        self.wait()
        self._regrow()
        return self.layout.own_slice(self.full)

    def start(self, source: torch.Tensor, comm) -> None:
        """All-gather `source` into the buffer over `comm` without waiting; the parameters point at
        the buffer from now on. `source` is kept alive until wait() (it may be a temporary)."""
        self.wait()
        self._regrow()
        self._source = source
        self._work = comm.all_gather_flat(self.full, source, async_op=True)
        self.layout.point_params_at(self.full)
        self._set(State.GATHERING)

    def wait(self) -> None:
        if self._work is not None:
            self._work.wait()
            self._work = self._source = None
        if self.state is State.GATHERING:
            self._set(State.GATHERED)

    def release(self) -> bool:
        """Free the buffer unless pinned or released already; True when it was freed now."""
        if self.state is State.RELEASED or self.pins:
            return False
        self.wait()
        self.full.untyped_storage().resize_(0)
        for p in self.layout.params:
            p.data = self.placeholder
        self._set(State.RELEASED)
        return True

    def pin(self) -> None:
        self.pins += 1

    def unpin(self) -> None:
        self.pins -= 1

    def _regrow(self) -> None:
        if self.full.untyped_storage().nbytes() == 0:
            self.full.untyped_storage().resize_(self.layout.padded_numel * self.full.element_size())

    def _set(self, state: State) -> None:
        self.state = state
        if self.on_change is not None:
            self.on_change(state)


def holder_of(param):
    """What gathers and releases `param` (a stage-3 unit, a stage-3 bucket kept whole, a zero.Init
    piece), or None for a parameter nothing partitions."""
    return getattr(param, "zt_holder", None)


def set_holder(params, holder) -> None:
    for p in params:
        p.zt_holder = holder
