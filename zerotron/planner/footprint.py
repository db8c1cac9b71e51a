"""Memory per GPU of one training layout: what the engine holds (model states: memory.py; activations:
activations.py) plus the pipeline's micro-batches in flight and the buffers collectives need; and
whether that fits the hardware. (Time per step: cost.py.)"""

from __future__ import annotations

import functools

from ..pipe.schedule import build_schedule, splits_backward
from .activations import activation_bytes, bytes_per_activation
from .hardware import GIB, Hardware
from .layout import Layout
from .memory import model_state_bytes
from .model import ModelShape
from .overlap import grad_buckets


@functools.lru_cache(maxsize=4096)
def in_flight(schedule: str, stages: int, micro_batches: int, chunks: int) -> tuple[int, ...]:
    """Per stage, the most chunk-micro-batches whose activations are alive at once."""
    peaks = []
    for actions in build_schedule(schedule, stages, micro_batches, chunks):
        alive = peak = 0
        frees = "W" if splits_backward(actions) else "B"  # zero bubble: activations live until W
        for a in actions:
            alive += 1 if a.kind == "F" else -1 if a.kind == frees else 0
            peak = max(peak, alive)
        peaks.append(peak)
    return tuple(peaks)


def memory(
    shape: ModelShape, layout: Layout, seq: int, dtype: str = "bf16", bucket_elements: int | None = None
) -> dict[str, int]:
    """Bytes per GPU, by part, on the most loaded rank: model states, activations, buffers; and
    "host" for what offload puts in host memory (per GPU)."""
    L = layout
    states = model_state_bytes(
        shape,
        dp=L.replicas,  # ZeRO shards over every rank holding the same parameters, sequence ranks included
        tp=L.tp,
        pp=L.pp,
        stage=L.zero,
        dtype=dtype,
        offload_optimizer=L.offload != "none" and L.zero > 0,
        offload_param=L.offload == "optimizer+param" and L.zero == 3,
        ep=L.ep,
    )
    host = states.pop("host", 0)
    states.pop("total")
    if host:  # what lives on the host is not GPU memory
        shard = states["optimizer"] // 8  # this rank's shard of every group (offload: ZeRO 1-3, 8 B of Adam each)
        if dtype == "fp32":  # the masters' fp32 gradients (bf16/fp16 keep none: CPU Adam reads the staging buffer)
            states["grads"] -= 4 * shard
        states["master_weights"] = states["optimizer"] = 0
        if L.offload == "optimizer+param" and L.zero == 3:
            states["params"] -= (4 if dtype == "fp32" else 2) * shard
    out = dict(states)
    out["activations"] = _activations(shape, L, seq, dtype)
    out["buffers"] = _buffers(shape, L, seq, dtype, bucket_elements)
    out["total"] = sum(out.values())
    out["host"] = host
    return out


def _activations(shape: ModelShape, L: Layout, seq: int, dtype: str) -> int:
    """Activations alive at the peak: one micro-batch without pipelining, the schedule's
    micro-batches in flight on each stage with it (the larger of the first and last stage). A rank
    of a split sequence keeps those of its own tokens."""
    kw = dict(dtype=dtype, tp=L.tp, sp=L.sequence_parallel, partition_activations=L.checkpoint != "none" and L.tp > 1)
    kw.update(ring=L.ring > 1, ep=L.ep, imbalance=L.expert_imbalance)
    if L.sequence_ranks > 1:
        seq = seq / L.sequence_ranks
    policy = L.checkpoint
    if L.pp == 1:
        return activation_bytes(shape, L.micro_batch, seq, policy, **kw)
    chunk_layers = -(-shape.layers // (L.pp * L.chunks))
    flight = in_flight(L.schedule, L.pp, L.grad_accum, L.chunks)
    per_chunk = activation_bytes(
        shape, L.micro_batch, seq, policy, layers=chunk_layers, first_stage=False, last_stage=False, **kw
    )
    embedding = activation_bytes(shape, L.micro_batch, seq, policy, layers=0, last_stage=False, **kw)
    head = activation_bytes(shape, L.micro_batch, seq, policy, layers=0, first_stage=False, **kw)
    first = flight[0] * (per_chunk + embedding)
    last = flight[-1] * (per_chunk + head)
    return max(first, last)


def _buffers(shape: ModelShape, L: Layout, seq: int, dtype: str, bucket_elements: int | None) -> int:
    """Transient buffers: ZeRO-2/3's gradient buckets in flight (two, while the previous one
    reduces; ZeRO-3's buckets are its layers), ZeRO-3's gathered layers (the one running and the
    one prefetched), pipeline send/receive buffers, and the logits' gradient in the head's backward.
    Ring attention's backward adds, for its layer: dq and the key/value gradients in fp32 with those
    arriving, and two key/value blocks (the one in use, the next arriving). Expert parallelism: a
    layer's routed rows on their way out and back in (the busiest rank's), beside what backward keeps."""
    b, a = (4 if dtype == "fp32" else 2), bytes_per_activation(dtype)
    layer = sum(shape.layer_elements(L.tp, L.ep))  # (ZeRO-3 gathers the rank's experts only)
    out = 0
    if L.zero == 2 and L.replicas > 1:  # two of the largest gradient buckets (zero/flat.py's rule)
        out += 2 * b * max(k.elements for k in grad_buckets(shape, L.tp, L.pp, seq, bucket_elements, L.ep))
    if L.zero == 3:  # two layers gathered, and (data-parallel) two layers' gradient buckets: a unit is one
        out += (4 if L.replicas > 1 else 2) * b * layer
    tokens = L.micro_batch * seq // L.sequence_ranks  # this rank's
    if L.ep > 1:
        out += int(2 * a * tokens * shape.top_k * L.expert_imbalance * shape.hidden)
    if L.ring > 1:
        kv = shape.hidden // shape.heads * shape.kv_heads
        out += tokens * (4 * shape.hidden + 16 * kv + 4 * a * kv) // L.tp
    if L.pp > 1:
        out += 2 * 2 * a * tokens * shape.hidden
    out += 4 * tokens * shape.vocab * (1 + shape.loss_copies) // L.tp
    return out


def fits(mem: dict[str, int], hw: Hardware, gpus_per_node: int | None = None) -> str | None:
    """Why the layout does not fit, or None."""
    usable = (hw.memory_gib - hw.reserve_gib) * GIB
    if mem["total"] > usable:
        return f"needs {mem['total'] / GIB:.1f} GiB per GPU, {hw.memory_gib - hw.reserve_gib:.0f} usable"
    per_node = gpus_per_node or hw.gpus_per_node
    if mem["host"] * per_node > hw.host_gib * GIB * 0.9:
        return f"offload needs {mem['host'] * per_node / GIB:.0f} GiB of host memory per node, {hw.host_gib:.0f} there"
    return None
