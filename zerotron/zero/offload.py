"""ZeRO-Offload: this rank's fp32 master shard, its gradient and the optimizer live in host memory.

Reduced gradient shards leave for the host as each bucket's reduction completes (while backward
goes on), in the model dtype (half the bytes in bf16); the optimizer steps on the host
(zerotron.ops.adam.CPUAdam by default, which reads the gradients where they arrived, chunk by
chunk, and writes the updated weights in their place); the updated weights come back in the
model dtype through that one host staging buffer. On a GPU the transfers run on a side stream,
ordered against the compute stream by
events, into pinned buffers of exactly the size needed. On a CPU-only machine "host" and
"device" are the same memory, and the same code runs.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools

import torch

from ..comm import host_buffer
from ..log import logger

HOST = torch.device("cpu")


def host_empty(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A host buffer of exactly `numel` elements, page-locked when `pin` (torch's pinned allocator
    rounds every block up to a power of two: up to twice the memory for large buffers)."""
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if not (pin and nbytes):
        return host_buffer(torch.zeros(numel, dtype=dtype, device=HOST))
    memory = _PinnedMemory(nbytes)
    if memory.registered:
        return host_buffer(torch.frombuffer(memory, dtype=dtype, count=numel))
    try:  # torch's allocator: pinned, rounded up
        return host_buffer(torch.zeros(numel, dtype=dtype, device=HOST, pin_memory=True))
    except RuntimeError as e:  # page-locked memory refused (a memlock limit): slower copies, still correct
        logger.warning(
            f"offload: {nbytes / 2**30:.2f} GiB of page-locked host memory refused ({e}); this buffer "
            "is pageable, so copies into it wait for the GPU"
        )
        return host_buffer(torch.zeros(numel, dtype=dtype, device=HOST))


def _cudart():
    """The CUDA runtime's Python binding (a stand-in in tests, to count registrations on a CPU)."""
    return torch.cuda.cudart()


def _take_cuda_error() -> None:
    """Clear CUDA's last error. A failed runtime call (cudaHostRegister at the host's page-lock limit) leaves
    it set, and the next kernel launch's check would report it as that kernel's failure, somewhere unrelated.
    torch binds no cudaGetLastError: it is called in the CUDA runtime this process loaded."""
    take = getattr(_cudart(), "cudaGetLastError", None) or getattr(_loaded_cudart(), "cudaGetLastError", None)
    if take is not None:
        take()


@functools.cache
def _loaded_cudart():
    """The CUDA runtime library this process loaded (torch's), or None where it cannot be found."""
    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps if "libcudart" in line and line.split()[-1][0] == "/"})
    except OSError:
        return None
    for path in paths:
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


def can_pin() -> bool:
    """Page-locked host memory needs a GPU driver."""
    return torch.cuda.is_available()


class _PinnedMemory(bytearray):
    """Host memory registered with the CUDA driver (page-locked) for exactly as long as it exists:
    the tensors made from it (torch.frombuffer) keep it alive, and when the last of them goes the
    registration is undone before the memory is freed, so a later allocation at the same address
    is never taken for pinned and no engine leaves pinned memory behind."""

    def __init__(self, nbytes: int):
        super().__init__(nbytes)  # zeroed
        self.address = ctypes.addressof(ctypes.c_char.from_buffer(self))
        try:
            status = _cudart().cudaHostRegister(self.address, nbytes, 0)
            self.registered = int(getattr(status, "value", status)) == 0
        except Exception:  # noqa: BLE001 (no cudart binding in this build)
            self.registered = False
            return
        if not self.registered:
            _take_cuda_error()

    def __del__(self):
        if getattr(self, "registered", False):
            self.registered = False
            _cudart().cudaHostUnregister(self.address)


class Uploads:
    """Host-to-device copies that feed a collective (ZeRO-3 offload_param: each gather's shard comes
    from host memory). On a GPU they run on a side stream, after what compute has queued, and the
    collective is issued from that stream, so it waits for the copy while compute goes on: the next
    unit's copy over PCIe overlaps the current unit's work. Elsewhere, the current stream."""

    def __init__(self):
        self.stream = torch.cuda.Stream() if torch.cuda.is_available() else None

    @contextlib.contextmanager
    def issue(self):
        if self.stream is None:
            yield
            return
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            yield


class HostBuffers:
    def __init__(self, numel: int, model_dtype: torch.dtype, pin_memory: bool):
        self.cuda = torch.cuda.is_available()
        # Pinned whatever pin_memory says (DeepSpeed's default is false): a device-to-host copy into
        # pageable memory makes the autograd thread wait for the GPU to drain, in the middle of backward.
        self.pin = can_pin()
        if self.pin and not pin_memory:
            logger.info(
                "offload_optimizer.pin_memory is false; zerotron page-locks its host buffers on GPUs anyway "
                "(copies into pageable memory would stall backward): see docs/offload.md"
            )
        self.masters = host_empty(numel, torch.float32, self.pin)
        self.staging = host_empty(numel, model_dtype, self.pin)
        # Gradients arrive in the model dtype, into the staging buffer: the weights it brought to
        # the device last step are there already (same stream). An optimizer that reads them
        # there itself (CPUAdam's grad_in) overwrites each chunk with its updated weights; any
        # other gets an fp32 copy (`grads`, made on first use). In fp32 training they land in
        # the fp32 buffer directly.
        self.grads = host_empty(numel, torch.float32, self.pin) if model_dtype == torch.float32 else None
        self.incoming = self.grads if model_dtype == torch.float32 else self.staging
        self.staging_has_weights = True  # False while gradients sit where the weights go back from
        self.copied_out = set()  # buckets whose gradient shard is on its way to the host
        self.on_gradient_out = None  # called with (bucket, device shard) as each shard leaves
        self.optimizer_copies_out = False  # the optimizer fills `staging` during its step
        self.stream = torch.cuda.Stream() if self.cuda else None

    def _on_side_stream(self):
        """The transfer stream, after what the compute stream has queued so far."""
        self.stream.wait_stream(torch.cuda.current_stream())
        return torch.cuda.stream(self.stream)

    def gradient_out(self, bucket, shard: torch.Tensor):
        """Send a bucket's reduced gradient shard to the host, asynchronously on a GPU."""
        if self.on_gradient_out is not None:
            self.on_gradient_out(bucket, shard)
        target = self.incoming[bucket.offset : bucket.offset + bucket.shard_numel]
        if self.stream is None:
            target.copy_(shard)
        else:
            with self._on_side_stream():
                target.copy_(shard, non_blocking=True)
                shard.record_stream(self.stream)  # its memory must outlive the copy
        self.copied_out.add(bucket.index)
        if self.incoming is self.staging:
            self.staging_has_weights = False

    def gradients_arrived(self, buckets, shard_of) -> torch.Tensor:
        """Send the buckets not sent yet and wait for every transfer; returns the host buffer
        the gradients are in (model dtype)."""
        for b in buckets:
            if b.index not in self.copied_out:
                self.gradient_out(b, shard_of(b))
        self.copied_out.clear()
        if self.stream is not None:
            self.stream.synchronize()
        return self.incoming

    def gradients_ready(self, buckets, shard_of) -> torch.Tensor:
        """gradients_arrived, then in fp32 on the host (for an optimizer that reads .grad)."""
        self.gradients_arrived(buckets, shard_of)
        if self.grads is None:
            self.grads = host_empty(self.masters.numel(), torch.float32, self.pin)
        if self.incoming is not self.grads:
            self.grads.copy_(self.incoming)
        return self.grads

    def stage_weights(self, from_masters: bool = False) -> None:
        """After a step: the staging buffer holds the updated weights in the model dtype. An
        optimizer that copies out (CPUAdam) wrote them there during its step; otherwise, or when
        the masters changed without a step (`from_masters`: a checkpoint was loaded), one pass
        casts the masters."""
        if from_masters or not self.optimizer_copies_out:
            self._cast_masters()
        self.staging_has_weights = True

    def _cast_masters(self) -> None:
        """The one full pass over the host shard: fp32 masters into the model-dtype staging buffer."""
        self.staging.copy_(self.masters)

    def weights_in(self, bucket, destination: torch.Tensor):
        """Bring a bucket's updated shard back into device memory, in the model dtype."""
        if not self.staging_has_weights:  # a skipped step left gradients there
            self._cast_masters()
            self.staging_has_weights = True
        source = self.staging[bucket.offset : bucket.offset + bucket.shard_numel]
        if self.stream is None:
            destination.copy_(source)
            return
        with self._on_side_stream():
            destination.copy_(source, non_blocking=True)
        torch.cuda.current_stream().wait_stream(self.stream)  # compute uses the weights after this

    def nbytes(self) -> int:
        buffers = {id(t): t for t in (self.masters, self.grads, self.incoming, self.staging) if t is not None}
        return sum(t.numel() * t.element_size() for t in buffers.values())


class FusedHostStep:
    """The offloaded step of an optimizer that reads the host gradients itself (CPUAdam's
    `grad_in`). As DeepSpeed does, the gradients are measured on the device as they leave for the
    host (each master run's norm; on a GPU this runs during backward and costs no host time);
    the host then makes one pass: each chunk unscaled and clipped in cache, updated, and written
    back in the model dtype (`apply`). The norms and products are those of the separate passes
    over an fp32 copy, bit for bit (a loss scale that is not a power of two can move a norm by
    an ulp)."""

    def __init__(
        self, host: HostBuffers, optimizer, masters: list, bounds: list[tuple[int, int]], run_in_bucket: list[tuple]
    ):
        """`masters[i]` is the master run at `bounds[i]` of the flat host buffers and at
        `run_in_bucket[i]` = (bucket, start, end) of that bucket's shard."""
        self.optimizer, self.masters = optimizer, masters
        self.runs_of_bucket: dict[int, list[tuple[int, int, int]]] = {}
        for i, (b, lo, hi) in enumerate(run_in_bucket):
            self.runs_of_bucket.setdefault(b.index, []).append((i, lo, hi))
        for m, (lo, hi) in zip(masters, bounds):
            optimizer.grad_in[m] = host.incoming[lo:hi]
        host.on_gradient_out = self.measure
        self._measured: list[torch.Tensor | None] = [None] * len(masters)
        self._shards: dict[int, torch.Tensor] = {}
        self.inv: torch.Tensor | None = None
        self.norms: list[torch.Tensor] = []

    def measure(self, bucket, shard: torch.Tensor) -> None:
        """A bucket's reduced shard leaves for the host: the norms of its master runs, in fp32."""
        runs = self.runs_of_bucket[bucket.index]
        norms = torch._foreach_norm([shard[lo:hi] for _, lo, hi in runs], 2, dtype=torch.float32)
        for (i, _, _), norm in zip(runs, norms):
            self._measured[i] = norm
        self._shards[bucket.index] = shard

    def inspect(self, inv_scale: float | None) -> torch.Tensor | None:
        """The NaN/Inf flag, and each run's norm after unscaling (kept for `norms`). A norm is
        finite exactly when its elements are, unless finite squares overflow: only then are the
        shards looked at element by element."""
        measured = torch.stack(self._measured)
        found = torch.zeros(1, device=measured.device)
        if not bool(torch.isfinite(measured).all()):
            if not all(bool(torch.isfinite(s).all()) for s in self._shards.values()):
                found.fill_(1.0)
        self._shards.clear()
        self.inv = None if inv_scale in (None, 1.0) else torch.full((), inv_scale, dtype=torch.float32)  # (host)
        scaled = measured if self.inv is None else measured * inv_scale  # (a Python number: no copy to the device)
        self.norms = list(scaled.unbind())
        return None if inv_scale is None else found

    def apply(self, clip_coef: torch.Tensor | None) -> None:
        coef = None if clip_coef is None else clip_coef.to(HOST, torch.float32)
        # (a factor of exactly 1 changes nothing: that pass is left out)
        self.optimizer.grad_multipliers = tuple(m for m in (self.inv, coef) if m is not None and float(m) != 1.0)
        try:
            self.optimizer.step()
        finally:
            self.optimizer.grad_multipliers = ()
