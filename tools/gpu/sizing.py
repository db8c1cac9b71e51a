"""The arithmetic that sizes the GPU runbook's offload part (no torch: unit-tested in
tests/test_gpu_runbook_smoke.py): pinned host blocks, offload's host bytes, the model states without offload,
how many layers fit the host, and the largest micro-batch that fits the GPU."""

from __future__ import annotations

GiB = 1 << 30


# ---- arithmetic (no torch: also unit-tested) ------------------------------------------------------
def pinned_bytes(n: int) -> int:
    """What torch's pinned-memory allocator takes for an n-byte tensor: it rounds every block up to a
    power of two (CachingHostAllocator; `pinned_max_round_threshold` can change that in recent torch)."""
    return 1 << max(0, (int(n) - 1).bit_length())


def offload_host_bytes(psi: int) -> int:
    """Host memory of zerotron's optimizer offload (world of one): fp32 masters and a bf16 staging
    buffer, where the gradients arrive and the weights leave from (zerotron/zero/offload.py, each
    pinned), plus AdamW's two fp32 moments; CPU Adam keeps no fp32 gradients."""
    return pinned_bytes(4 * psi) + pinned_bytes(2 * psi) + 8 * psi


def states_bytes_without_offload(psi: int) -> tuple[int, int]:
    """GPU model-state bytes of zerotron bf16 + AdamW without offload (stage 2, world of one):
    (persistent: bf16 params + bf16 gradients + fp32 masters + two fp32 moments = 16 B/param,
    peak in the step: + the fp32 gradients = 20 B/param)."""
    return 16 * psi, 20 * psi


def pick_layers(fixed: int, per_layer: int, n_layer: int, host_budget: int) -> int:
    """The most layers (<= n_layer) whose model's offload host memory fits `host_budget` (0: none)."""
    best = 0
    for layers in range(1, n_layer + 1):
        if offload_host_bytes(fixed + layers * per_layer) <= host_budget:
            best = layers
    return best


def choose_micro_batch(base: float, per_sample: float, capacity: float, fraction: float, cap: int) -> int | None:
    """The largest micro-batch b (1..cap) with base + b * per_sample <= fraction * capacity; None when the
    measurement is unusable."""
    if per_sample is None or per_sample <= 0 or base is None:
        return None
    return max(1, min(cap, int((fraction * capacity - base) // per_sample)))


def gib(n) -> float | None:
    return None if n is None else n / GiB
