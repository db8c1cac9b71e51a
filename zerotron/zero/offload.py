"""ZeRO-Offload: this rank's fp32 master shard, its gradient and the optimizer live in host memory.

Reduced gradient shards are copied out to the host as each bucket's reduction completes (while
backward goes on), the optimizer steps on the host (zerotron.ops.adam.CPUAdam by default), and the
updated weights come back in the model dtype through one host staging buffer (which CPUAdam fills
while each chunk is still in cache). On a GPU the buffers are pinned and the copies asynchronous;
on a CPU-only machine "host" and "device" are the same memory, and the same code runs.
"""
from __future__ import annotations

import torch

HOST = torch.device("cpu")


class HostBuffers:
    def __init__(self, numel: int, model_dtype: torch.dtype, pin_memory: bool):
        pin = pin_memory and torch.cuda.is_available()  # pinning needs a GPU driver
        self.masters = torch.zeros(numel, dtype=torch.float32, device=HOST, pin_memory=pin)
        self.grads = torch.zeros(numel, dtype=torch.float32, device=HOST, pin_memory=pin)
        self.staging = torch.zeros(numel, dtype=model_dtype, device=HOST, pin_memory=pin)
        self.copied_out = set()        # buckets whose gradient shard is on the host already
        self.optimizer_copies_out = False  # the optimizer fills `staging` during its step

    def gradient_out(self, bucket, shard: torch.Tensor):
        """Send a bucket's reduced gradient shard to the host (asynchronously from device memory)."""
        self.grads[bucket.offset:bucket.offset + bucket.shard_numel].copy_(shard, non_blocking=True)
        self.copied_out.add(bucket.index)

    def gradients_ready(self, buckets, shard_of):
        """Copy out the buckets not sent yet and wait for every copy; returns the host gradients."""
        for b in buckets:
            if b.index not in self.copied_out:
                self.gradient_out(b, shard_of(b))
        self.copied_out.clear()
        if torch.cuda.is_available():
            torch.cuda.current_stream().synchronize()
        return self.grads

    def weights_in(self, bucket, destination: torch.Tensor):
        """Bring a bucket's updated shard back into device memory, in the model dtype."""
        destination.copy_(self.staging[bucket.offset:bucket.offset + bucket.shard_numel], non_blocking=True)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.masters, self.grads, self.staging))
