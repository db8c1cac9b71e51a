"""ZeRO stages 1-3, the optimizer side: fp32 master weights, their gradients and optimizer states
exist only for this rank's shard of each flat bucket.

- Stage 1: gradients accumulate in full buckets (as in data parallelism); at the boundary each
  bucket is reduce-scattered while backward runs: each rank receives its own shard's sum.
- Stages 2 and 3: every micro-batch's gradients are copied into a short-lived bucket buffer as
  they arrive and reduce-scattered at once; the reduced shard is added into the gradient shard,
  so no rank ever holds a full gradient for longer than a bucket is in flight.

Gradient shards stay in the model dtype until the step (the ZeRO paper's 2 bytes per element);
the fp32 copy the optimizer reads replaces them bucket by bucket at the step (in fp32 training it
is the gradient shard itself). Between a step and the next backward no gradient memory is held,
and what a backward holds in flight is bounded by two buckets (one filling, one reducing).

After the optimizer updates the master shard, each rank writes it (in the model dtype) into its
parameter shard; buckets whose parameters are replicated (stages 1, 2, and small parameters in
stage 3) are then all-gathered, while stage 3's partitioned units are gathered on their next use.
"""

from __future__ import annotations

from collections import deque

import torch

from ..comm import Comm
from .grads import AccumulatedGrads, StreamedGrads
from .replicated import InOrderReduction
from .shard_group import ShardGroups
from .sharded_bucket import ShardedBucket
from .steps import HostStep, step_for

_MAX_REDUCTIONS_IN_FLIGHT = 1


class ShardedStates(InOrderReduction):
    """Owns gradient reduction, master shards and parameter publishing for `buckets`."""

    def __init__(
        self,
        buckets: list[ShardedBucket],
        partitioned: set[int],
        group_of: dict[int, int],
        groups: ShardGroups,
        stage: int,
        allgather_numel: int,
        reduce_dtype: torch.dtype | None = None,
        on_grads_done=None,
        offload=None,
        sub_group_numel: int | None = None,
        reshard: bool = False,
        overlap_gather: bool = False,
    ):
        self.buckets = buckets
        self.partitioned = partitioned  # indices of buckets whose full parameters are not kept
        # Gradient reductions start from backward hooks, whose timing can differ between ranks
        # (a parameter unused on one rank); parameter gathers start from forward/backward order.
        # Each kind gets its own process group, so only the order within a kind must agree. Each
        # bucket is reduced and gathered over its own ShardGroup (experts: their expert-data ranks).
        self.groups, self.stage = groups, stage
        self.allgather_numel = allgather_numel
        self.reduce_dtype = reduce_dtype
        self.on_grads_done = on_grads_done  # stage 3: release a unit once its gradients are in
        self.offload = offload  # OffloadConfig of offload_optimizer, or None
        self.host = None  # HostBuffers when offloading
        self.sync = True
        self.open = False  # is a backward of this engine running?
        self.grads = AccumulatedGrads() if stage == 1 else StreamedGrads()
        self._next_launch = 0
        self._in_flight: deque = deque()
        self._where: dict[int, tuple[ShardedBucket, int]] = {}
        self._build_masters(group_of, own_master_storage=reshard)
        from .param_gather import ReplicatedParams

        self.params = ReplicatedParams(
            [b for i, b in enumerate(buckets) if i not in partitioned], allgather_numel, reshard, overlap_gather
        )
        self._step = step_for(self, sub_group_numel)  # adopt may change it (the fused host step)
        self.peak_fp32_grad_numel = 0  # the most fp32 gradient elements held at once (a measurement)
        for b in buckets:
            for i, p in enumerate(b.params):
                self._where[id(p)] = (b, i)
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._on_grad_ready)
            for b in buckets
            for p in b.params
            if p.requires_grad
        ]

    # ---- masters --------------------------------------------------------------------------
    def _build_masters(self, group_of: dict[int, int], own_master_storage: bool = False):
        """One fp32 buffer holds every bucket's master shard. Each shard is cut where the optimizer
        group changes, and each run is one tensor the optimizer updates (runs of parameters that no
        optimizer group holds, e.g. frozen ones, are never updated). `own_master_storage`: the
        full buffers are freed after backward, so an fp32 master shard cannot be a view of one."""
        total = sum(b.shard_numel for b in self.buckets)
        device, dtype = self.buckets[0].device, self.buckets[0].dtype
        self.total_numel = total
        # In fp32 training the parameter shard already is an fp32 master: the optimizer updates it
        # in place (no second copy). Otherwise one fp32 buffer holds every bucket's master shard.
        # With offload the masters live in host memory (zero/offload.py), in fp32 training too.
        self.masters_are_params = dtype == torch.float32 and self.offload is None
        if self.offload is not None:
            from .offload import HostBuffers

            self.host = HostBuffers(total, dtype, self.offload.pin_memory)
            self.master_flat = self.host.masters
        else:
            self.master_flat = (
                None if self.masters_are_params else torch.zeros(total, dtype=torch.float32, device=device)
            )
        self.master_grad_flat = None  # fp32 gradients, during the step only
        self.runs: list[tuple[int | None, torch.nn.Parameter]] = []  # (optimizer group, master tensor)
        self._run_bounds: list[tuple[int, int]] = []
        self.run_norm_param: list[torch.nn.Parameter] = []  # a parameter standing for each run's norm share
        self.run_in_bucket: list[tuple[ShardedBucket, int, int]] = []
        offset = 0
        for index, b in enumerate(self.buckets):
            b.index = index
            b.offset = offset
            if self.masters_are_params:
                if own_master_storage and index not in self.partitioned:
                    b.shard = b.shard.clone()
                b.master = b.shard
            else:
                b.master = self.master_flat[offset : offset + b.shard_numel]
                b.master.copy_(b.shard.float())
            # [(optimizer group, norm share), start in shard, a parameter of the run]; padding
            # joins the last run
            runs: list[list] = []
            for i, _, start, _ in b.param_slices_in_shard():
                key = self._run_key(b.params[i], group_of)
                if not runs or runs[-1][0] != key:
                    runs.append([key, start, b.params[i]])
            last = b.params[-1]
            runs = runs or [[self._run_key(last, group_of), 0, last]]
            ends = [start for _, start, _ in runs[1:]] + [b.shard_numel]
            for ((group, _), lo, param), hi in zip(runs, ends):
                self.runs.append((group, torch.nn.Parameter(b.master[lo:hi])))
                self.run_norm_param.append(param)
                self._run_bounds.append((offset + lo, offset + hi))
                self.run_in_bucket.append((b, lo, hi))
            offset += b.shard_numel

    @staticmethod
    def _run_key(param, group_of):
        return group_of.get(id(param)), (getattr(param, "tp_replicated", False), getattr(param, "tied_copies", 1))

    def adopt(self, optimizer: torch.optim.Optimizer, allow_untested: bool = False) -> None:
        # Running the optimizer on flat shards is exact only for an elementwise update: trusted
        # classes pass, known non-elementwise ones are refused, any other is probed first.
        # `allow_untested`: DeepSpeed's "zero_allow_untested_optimizer" key.
        from ..optim import check_shardable

        check_shardable(
            optimizer,
            stage=self.stage,
            device=self.runs[0][1].device if self.runs else None,
            allow_untested=allow_untested,
        )
        if optimizer.state:
            raise ValueError("the optimizer already has state; pass a fresh optimizer to zerotron.initialize")
        for gi, group in enumerate(optimizer.param_groups):
            group["params"] = [m for g, m in self.runs if g == gi]
        if self.host is not None and hasattr(optimizer, "copy_out"):  # CPUAdam writes the staging buffer itself
            for (_, m), (lo, hi) in zip(self.runs, self._run_bounds):
                optimizer.copy_out[m] = self.host.staging[lo:hi]
            self.host.optimizer_copies_out = True
        if self.host is not None and hasattr(optimizer, "grad_in"):  # ... and reads the gradients itself
            from .offload import FusedHostStep

            self._step = HostStep(
                self,
                FusedHostStep(self.host, optimizer, [m for _, m in self.runs], self._run_bounds, self.run_in_bucket),
            )

    def grad_norms(self) -> list[torch.Tensor]:
        return self._step.norms()

    def apply_update(self, optimizer: torch.optim.Optimizer, clip_coef: torch.Tensor | None) -> None:
        self._step.apply(optimizer, clip_coef)

    def master_grads(self) -> list[torch.Tensor]:
        return [m.grad for _, m in self.runs]

    def norm_weights(self, tp: int) -> list[float] | None:
        from ..precision import norm_share

        weights = [norm_share(p, tp) for p in self.run_norm_param]
        return None if all(w == 1.0 for w in weights) else weights

    def make_master_grads(self):
        """The fp32 gradients of the master shard, pointed at by every master run's .grad. In fp32
        they are the reduced gradient shards themselves; otherwise an fp32 copy for the step."""
        self.grads.outside.check()
        if self.masters_are_params:  # fp32 without offload: the reduced shards themselves
            self.master_grad_flat = None
            for (_, m), (b, lo, hi) in zip(self.runs, self.run_in_bucket):
                m.grad = self.grads.shard(b)[lo:hi]
            return
        if self.host is not None:
            self.master_grad_flat = self.host.gradients_ready(self.buckets, self.reduced_shard)
        else:
            # Bucket by bucket, each model-dtype shard freed once copied: the step holds the fp32
            # gradients, not both (as DeepSpeed's stages 1-2)
            self.master_grad_flat = None
            fp32 = {}
            for b in self.buckets:
                fp32[b.index] = self.grads.shard(b).float()
                self.grads.release(b)
            self.peak_fp32_grad_numel = max(self.peak_fp32_grad_numel, self.total_numel)
            for (_, m), (b, lo, hi) in zip(self.runs, self.run_in_bucket):
                m.grad = fp32[b.index][lo:hi]
            return
        for (_, m), (lo, hi) in zip(self.runs, self._run_bounds):
            m.grad = self.master_grad_flat[lo:hi]

    def reduced_shard(self, b: ShardedBucket) -> torch.Tensor:
        """This rank's reduced gradient shard of bucket `b` (after the boundary's reduction)."""
        return self.grads.shard(b)

    @property
    def norm_group(self):
        return self.groups.norm_group

    def bucket_of(self, param) -> ShardedBucket | None:
        where = self._where.get(id(param))
        return None if where is None else where[0]

    # ---- backward -------------------------------------------------------------------------
    def begin_backward(self, sync: bool) -> None:
        self.sync, self.open = sync, True

    def _on_grad_ready(self, param: torch.nn.Parameter):
        bucket, i = self._where[id(param)]
        if not self.open:  # another engine's backward (stage 3 refuses it)
            return self.grads.outside.add(bucket, i, param)
        self.grads.outside.discard(param)  # (its .grad holds both backwards' now)
        if self.grads.take(bucket, i, param, self.sync):
            self._mark_ready(bucket, i, param)
        self._complete_finished()

    def _complete_finished(self):
        """Take in the reductions that have finished, so their bucket buffers are freed as soon
        as possible rather than when the in-flight limit forces a wait."""
        while self._in_flight and self._in_flight[0][1].is_completed():
            self._complete_oldest()

    def _launch(self, bucket: ShardedBucket, in_backward: bool):
        if self.sync and bucket.index not in self.partitioned:
            self.params.release(bucket)  # reshard_after_backward: nothing needs them before the step
        full = self.grads.to_reduce(bucket)
        if full is None:  # no parameter of this bucket got a gradient in this backward
            full = torch.zeros(bucket.padded_numel, dtype=bucket.dtype, device=bucket.device)
        if self.reduce_dtype is not None and self.reduce_dtype != full.dtype:
            full = full.to(self.reduce_dtype)
        full.div_(bucket.group.replicas)  # average; dividing first keeps fp16 sums in range
        received = bucket.own_slice(full)  # reduced in place: no second buffer per bucket in flight
        work = bucket.group.reduce.reduce_scatter_flat(received, full, async_op=True)
        bucket.launched_in_backward = in_backward
        self._in_flight.append((bucket, work, received, full))
        if self.on_grads_done is not None:
            self.on_grads_done(bucket)
        while len(self._in_flight) > _MAX_REDUCTIONS_IN_FLIGHT:
            self._complete_oldest()

    def _complete_oldest(self):
        bucket, work, received, _ = self._in_flight.popleft()
        work.wait()
        self.grads.reduced(bucket, received)
        # The boundary backward: this shard is final, send it out while backward goes on. What is
        # reduced after backward (a pipeline's reduction, whose tied weights are then summed between
        # stages) goes out at the step.
        if self.host is not None and self.sync and bucket.launched_in_backward:
            self.host.gradient_out(bucket, self.grads.shard(bucket))

    def end_backward(self) -> None:
        """Reduce what is left (buckets without gradients too), and wait for every reduction."""
        self.open = False
        for bucket, i, param in self.grads.outside.take():
            if self.grads.take(bucket, i, param, self.sync):
                self._mark_ready(bucket, i, param)
        if not self.grads.begin_reduction(self.sync):
            return
        self._launch_ready(in_backward=False)
        while self._in_flight:
            self._complete_oldest()
        for b in self.buckets:
            b.ready.clear()
        self._next_launch = 0

    def reduce_accumulated(self) -> None:
        """Pipeline schedules accumulate every micro-batch without reducing (stage 1) and reduce
        once after the last backward; stage 2 already reduced each backward's gradients."""
        if self.grads.accumulates:
            self.sync = True
            self.end_backward()

    def reduced_grads(self, params) -> list[torch.Tensor]:
        """After the reduction: this rank's reduced gradient shards of the buckets holding `params`,
        which must hold nothing else (see `isolate` in zero.make_model_states)."""
        wanted = {id(p) for p in params}
        buckets = []
        for p in params:
            b, _ = self._where[id(p)]
            if any(id(q) not in wanted for q in b.params):
                raise RuntimeError("reduced_grads needs the parameters in buckets of their own")
            if b not in buckets:
                buckets.append(b)
        return [self.grads.shard(b) for b in buckets]

    replicated = False  # each data-parallel rank holds its own shard

    def pieces(self):
        """(parameter, start, length, master, offset in master) of each parameter piece in this
        rank's master shard."""
        for (_, m), (b, lo, hi) in zip(self.runs, self.run_in_bucket):
            for i, start_in_param, start_in_shard, length in b.param_slices_in_shard():
                if lo <= start_in_shard < hi:
                    yield b.params[i], start_in_param, length, m, start_in_shard - lo

    # ---- after the optimizer step ---------------------------------------------------------
    def unscale_and_check(self, inv_scale: float | None) -> torch.Tensor | None:
        return self._step.inspect(inv_scale)

    @torch.no_grad()
    def publish(self, from_masters: bool = False) -> None:
        """Write the updated master shards into the parameters; all-gather replicated buckets.
        `from_masters`: the masters changed without an optimizer step (a checkpoint was loaded)."""
        if self.host is not None:
            self.host.stage_weights(from_masters)
        for i in sorted(self.partitioned):  # (stage 3 without a shard gathers from the master itself)
            if self.buckets[i].shard is not None:
                self._write_master(self.buckets[i], self.buckets[i].shard)
        self.params.gather(self.params.buckets, self._write_master)

    def _write_master(self, b: ShardedBucket, destination: torch.Tensor) -> None:
        """This rank's updated weights of bucket `b`, in the model dtype, into `destination`."""
        if self.host is not None:
            self.host.weights_in(b, destination)
        elif destination.data_ptr() != b.master.data_ptr():
            destination.copy_(b.master)

    def destroy(self) -> None:
        for h in self._hooks:
            h.remove()
        self.params.destroy()

    def zero_grads(self) -> None:
        if self.params.released:  # a skipped step: the parameters come back unchanged
            self.params.gather(self.params.released, self._write_master)
        self.master_grad_flat = None
        for _, m in self.runs:
            m.grad = None
        self.grads.zero(self.buckets)

    def memory(self) -> dict[str, int]:
        out = {
            "grads": self.grads.nbytes(self.buckets),
            "master_weights": 0 if self.master_flat is None else self.master_flat.numel() * 4,
        }
        if self.host is not None:  # in host memory: masters, the staging buffer, fp32 gradients if any
            out["grads"] += 0 if self.host.grads is None else self.host.grads.numel() * 4
            out["host"] = self.host.nbytes()
        return out

    # ---- one parameter, from outside a step ------------------------------------------------------
    def param_shape(self, param) -> torch.Size | None:
        where = self._where.get(id(param))
        return None if where is None else torch.Size(where[0].shapes[where[1]])

    def grad_pieces(self, param):
        b, i = self._where[id(param)]
        return [
            (start, length, self.reduced_shard(b), at) for j, start, at, length in b.param_slices_in_shard() if j == i
        ]

    def grads_changed(self, params) -> None:
        if self.host is not None:
            for p in params:
                self.host.copied_out.discard(self._where[id(p)][0].index)

    @torch.no_grad()
    def republish(self, params, comm: Comm | None = None) -> None:
        """publish(from_masters=True) for the buckets of `params` only (`comm`: for the dense ones)."""
        from ..comm import to_device

        replicated = []
        for b in sorted({id(b): b for b in map(self.bucket_of, params)}.values(), key=lambda b: b.index):
            if self.host is not None:
                self.host.staging[b.offset : b.offset + b.shard_numel].copy_(b.master)
            if b.index not in self.partitioned:
                replicated.append(b)
                continue
            if b.shard is not None:
                self._write_master(b, b.shard)
            if not b.residency.released:  # a stage-3 unit gathered right now too
                over = comm if comm is not None and b.group.dense else b.group.gather
                over.all_gather_flat(b.full, to_device(b.own_values(), b.full.device).clone())
        self.params.gather(replicated, self._write_master, dense_comm=comm, wait=True)
