"""Stages 1-2: the full parameters of the replicated buckets, from the step's all-gather to the
next backward.

After the optimizer has updated this rank's master shard, every replicated bucket is written
from it and all-gathered (`gather`). Two options of zero_optimization change when:

- reshard_after_backward (FSDP2's name): at the accumulation boundary each bucket's full buffer
  is freed as soon as its gradients are in, and the step's gather makes it again. From then to
  the step the parameters read as empty tensors, as stage 3's released ones do, and a rank holds
  only shards: what FSDP2 does with reshard_after_forward=False.
- overlap_param_gather (Megatron-LM's name): the step starts the gathers without waiting on
  them, and each module waits, just before its forward, for the buckets holding its own
  parameters, so the gathers overlap the next forward. Reading the parameters any other way
  before that forward needs `settle()` first; the model's state_dict() does it.
"""
from __future__ import annotations

import torch

from ..comm import Comm
from .flat import FlatBucket


class ReplicatedParams:
    def __init__(self, buckets: list[FlatBucket], comm: Comm, allgather_numel: int, reshard: bool, overlap: bool):
        self.buckets, self.comm, self.allgather_numel = buckets, comm, allgather_numel
        self.reshard, self.overlap = reshard, overlap
        self.released: set[int] = set()              # buckets whose full buffer is freed
        self.pending: dict[int, object] = {}         # bucket index -> its all-gather in flight
        self._placeholders = {b.index: torch.empty(0, dtype=b.dtype, device=b.device) for b in buckets}
        self._hooks: list = []

    # ---- backward ---------------------------------------------------------------------------
    def release(self, b: FlatBucket) -> None:
        """The boundary backward is done with `b`'s parameters: free the full buffer (views that
        autograd may still hold see the storage shrink, which is what returns the memory)."""
        if not self.reshard or b.index in self.released:
            return
        self.wait([b.index])
        b.full.untyped_storage().resize_(0)
        for p in b.params:
            p.data = self._placeholders[b.index]
        self.released.add(b.index)

    # ---- the step ---------------------------------------------------------------------------
    @torch.no_grad()
    def gather(self, buckets: list[FlatBucket], write, comm: Comm | None = None, wait: bool = False) -> None:
        """Write each bucket's own slice (`write(bucket, destination)`) and all-gather it in place,
        in the order the next forward uses them (first buckets last: they hold the last layers).
        Without overlap, at most allgather_bucket_size elements are in flight at once; with it,
        none is waited on here."""
        comm = comm or self.comm
        self.wait([b.index for b in buckets])  # a bucket's earlier gather, before writing it again
        in_flight: list[int] = []
        numel = 0
        for b in sorted(buckets, key=lambda b: -b.index):
            if b.index in self.released:
                b.full.untyped_storage().resize_(b.padded_numel * b.full.element_size())
            destination = b.own_slice(b.full)
            write(b, destination)
            self.pending[b.index] = comm.all_gather_flat(b.full, destination, async_op=True)
            if b.index in self.released:
                b.point_params_at(b.full)
                self.released.discard(b.index)
            in_flight.append(b.index)
            numel += b.padded_numel
            if numel >= self.allgather_numel and not self.overlap:
                self.wait(in_flight)
                in_flight, numel = [], 0
        if wait or not self.overlap:
            self.wait(in_flight)

    def wait(self, indices) -> None:
        for i in indices:
            work = self.pending.pop(i, None)
            if work is not None:
                work.wait()

    def settle(self) -> None:
        """Every gather done: the parameters hold the stepped weights."""
        self.wait(list(self.pending))

    # ---- the next forward (overlap_param_gather) ----------------------------------------------
    def watch(self, module: torch.nn.Module, where: dict[int, tuple[FlatBucket, int]]) -> None:
        """Each module waits, before its forward, for the buckets holding its own parameters (a
        ParameterList's or ParameterDict's count as their parent's: those never run a forward);
        the model's state_dict waits for all of them."""
        containers = (torch.nn.ParameterList, torch.nn.ParameterDict)
        for m in module.modules():
            if isinstance(m, containers):
                continue
            own = list(m.parameters(recurse=False))
            own += [p for c in m.children() if isinstance(c, containers) for p in c.parameters()]
            indices = sorted({where[id(p)][0].index for p in own if id(p) in where})
            if indices:
                self._hooks.append(m.register_forward_pre_hook(lambda mod, args, ix=indices: self.wait(ix)))
        self._hooks.append(module.register_state_dict_pre_hook(lambda *args, **kwargs: self.settle()))

    def destroy(self) -> None:
        self.settle()
        for h in self._hooks:
            h.remove()
