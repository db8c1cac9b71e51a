"""ZeRO-Offload: this rank's fp32 master shard, its gradient and the optimizer live in host memory.

Reduced gradient shards leave for the host as each bucket's reduction completes (while backward
goes on), in the model dtype (half the bytes in bf16), and become fp32 on the host; the optimizer
steps on the host (zerotron.ops.adam.CPUAdam by default); the updated weights come back in the
model dtype through one host staging buffer (which CPUAdam fills while each chunk is still in
cache). On a GPU the transfers run on a side stream, ordered against the compute stream by
events, into pinned buffers of exactly the size needed. On a CPU-only machine "host" and
"device" are the same memory, and the same code runs.
"""
from __future__ import annotations

import torch

from ..comm import host_buffer

HOST = torch.device("cpu")


def host_empty(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A host buffer of exactly `numel` elements, page-locked when `pin` (torch's pinned allocator
    rounds every block up to a power of two: up to twice the memory for large buffers)."""
    t = torch.zeros(numel, dtype=dtype, device=HOST)
    if pin and t.numel():
        try:
            status = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
            registered = int(getattr(status, "value", status)) == 0
        except Exception:  # noqa: BLE001 (no cudart binding in this build)
            registered = False
        if not registered:  # fall back to torch's pinned allocator (rounded up, but pinned)
            t = torch.zeros(numel, dtype=dtype, device=HOST, pin_memory=True)
    return host_buffer(t)


class HostBuffers:
    def __init__(self, numel: int, model_dtype: torch.dtype, pin_memory: bool):
        self.cuda = torch.cuda.is_available()
        pin = pin_memory and self.cuda  # pinning needs a GPU driver
        self.masters = host_empty(numel, torch.float32, pin)
        self.grads = host_empty(numel, torch.float32, pin)
        self.staging = host_empty(numel, model_dtype, pin)
        # Gradients arrive in the model dtype, into the staging buffer: the weights it brought to
        # the device last step are there already (same stream), and the next step refills it only
        # after the gradients became fp32. In fp32 training they land in the fp32 buffer directly.
        self.incoming = self.grads if model_dtype == torch.float32 else self.staging
        self.copied_out = set()        # buckets whose gradient shard is on its way to the host
        self.optimizer_copies_out = False  # the optimizer fills `staging` during its step
        self.stream = torch.cuda.Stream() if self.cuda else None

    def _on_side_stream(self):
        """The transfer stream, after what the compute stream has queued so far."""
        self.stream.wait_stream(torch.cuda.current_stream())
        return torch.cuda.stream(self.stream)

    def gradient_out(self, bucket, shard: torch.Tensor):
        """Send a bucket's reduced gradient shard to the host, asynchronously on a GPU."""
        target = self.incoming[bucket.offset:bucket.offset + bucket.shard_numel]
        if self.stream is None:
            target.copy_(shard)
        else:
            with self._on_side_stream():
                target.copy_(shard, non_blocking=True)
                shard.record_stream(self.stream)  # its memory must outlive the copy
        self.copied_out.add(bucket.index)

    def gradients_ready(self, buckets, shard_of):
        """Send the buckets not sent yet, wait for every transfer, convert to fp32 on the host;
        returns the host gradients."""
        for b in buckets:
            if b.index not in self.copied_out:
                self.gradient_out(b, shard_of(b))
        self.copied_out.clear()
        if self.stream is not None:
            self.stream.synchronize()
        if self.incoming is not self.grads:
            self.grads.copy_(self.incoming)
        return self.grads

    def weights_in(self, bucket, destination: torch.Tensor):
        """Bring a bucket's updated shard back into device memory, in the model dtype."""
        source = self.staging[bucket.offset:bucket.offset + bucket.shard_numel]
        if self.stream is None:
            destination.copy_(source)
            return
        with self._on_side_stream():
            destination.copy_(source, non_blocking=True)
        torch.cuda.current_stream().wait_stream(self.stream)  # compute uses the weights after this

    def nbytes(self) -> int:
        buffers = {id(t): t for t in (self.masters, self.grads, self.incoming, self.staging)}
        return sum(t.numel() * t.element_size() for t in buffers.values())
