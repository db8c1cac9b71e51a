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
from .residency import State
from .sharded_bucket import ShardedBucket


class ReplicatedParams:
    def __init__(self, buckets: list[ShardedBucket], allgather_numel: int, reshard: bool, overlap: bool):
        self.buckets, self.allgather_numel = buckets, allgather_numel
        self.reshard, self.overlap = reshard, overlap
        self._hooks: list = []

    @property
    def released(self) -> list[ShardedBucket]:
        """Buckets whose full buffer is freed (reshard_after_backward, until the step's gather)."""
        return [b for b in self.buckets if b.residency.released]

    @property
    def pending(self) -> list[ShardedBucket]:
        """Buckets whose all-gather is in flight (not waited on yet)."""
        return [b for b in self.buckets if b.residency.state is State.GATHERING]

    # ---- backward ---------------------------------------------------------------------------
    def release(self, b: ShardedBucket) -> None:
        """The boundary backward is done with `b`'s parameters: free the full buffer."""
        if self.reshard:
            b.residency.release()

    # ---- the step ---------------------------------------------------------------------------
    @torch.no_grad()
    def gather(self, buckets: list[ShardedBucket], write, dense_comm: Comm | None = None, wait: bool = False) -> None:
        """Write each bucket's own slice (`write(bucket, destination)`) and all-gather it in place over
        its group (`dense_comm` instead for dense buckets, if given), in the order the next forward
        uses them (first buckets last: they hold the last layers). Without overlap, at most
        allgather_bucket_size elements are in flight at once; with it, none is waited on here."""
        in_flight: list[ShardedBucket] = []
        numel = 0
        for b in sorted(buckets, key=lambda b: -b.index):
            destination = b.residency.own_slice()
            write(b, destination)
            b.residency.start(destination, dense_comm if dense_comm is not None and b.group.dense else b.group.gather)
            in_flight.append(b)
            numel += b.padded_numel
            if numel >= self.allgather_numel and not self.overlap:
                self.wait(in_flight)
                in_flight, numel = [], 0
        if wait or not self.overlap:
            self.wait(in_flight)

    @staticmethod
    def wait(buckets) -> None:
        for b in buckets:
            b.residency.wait()

    def settle(self) -> None:
        """Every gather done: the parameters hold the stepped weights."""
        self.wait(self.buckets)

    # ---- the next forward (overlap_param_gather) ----------------------------------------------
    def watch(self, module: torch.nn.Module, bucket_of) -> None:
        """Each module waits, before its forward, for the buckets holding its own parameters (a
        ParameterList's or ParameterDict's count as their parent's: those never run a forward);
        the model's state_dict waits for all of them. `bucket_of(param)`: its bucket, or None."""
        containers = (torch.nn.ParameterList, torch.nn.ParameterDict)
        for m in module.modules():
            if isinstance(m, containers):
                continue
            own = list(m.parameters(recurse=False))
            own += [p for c in m.children() if isinstance(c, containers) for p in c.parameters()]
            mine = {b.index: b for b in map(bucket_of, own) if b is not None}
            waited = [mine[i] for i in sorted(mine)]
            if waited:
                self._hooks.append(m.register_forward_pre_hook(lambda mod, args, bs=waited: self.wait(bs)))
        self._hooks.append(module.register_state_dict_pre_hook(lambda *args, **kwargs: self.settle()))

    def destroy(self) -> None:
        self.settle()
        for h in self._hooks:
            h.remove()
