"""The cost model: memory per GPU and time per step of one training layout.

Memory is what the engine holds (model states: memory.py; activations: activations.py) plus the
pipeline's micro-batches in flight and the buffers collectives need. Time is compute (FLOPs at the
hardware's calibrated efficiency, recomputation included) stretched by the pipeline bubble, plus
the communication the engine cannot hide behind compute, from an alpha-beta model per link level.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from ..pipe.schedule import build_schedule, splits_backward
from .activations import activation_bytes, bytes_per_activation
from .hardware import GIB, Hardware
from .memory import model_state_bytes
from .model import ModelShape


STAGE3_MAX_REUSE_DISTANCE = 1e9  # DeepSpeed's default, which the engine applies (zero/stage3.py)


@dataclass(frozen=True)
class Layout:
    """One training configuration: how the GPUs split the work, and the memory savers used."""
    dp: int
    tp: int = 1
    pp: int = 1
    zero: int = 1
    micro_batch: int = 1
    grad_accum: int = 1              # micro-batches per step on each data-parallel rank
    checkpoint: str = "none"         # none | selective | every_block
    offload: str = "none"            # none | optimizer | optimizer+param
    schedule: str = "1f1b"           # gpipe | 1f1b | interleaved (pp > 1)
    chunks: int = 1                  # virtual stages per rank (interleaved)
    sequence_parallel: bool = False
    overlap_param_gather: bool = False  # ZeRO-1/2: the step's all-gather hidden under the next forward

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp

    def describe(self) -> str:
        parts = [f"dp{self.dp}", f"tp{self.tp}{'+sp' if self.sequence_parallel else ''}", f"pp{self.pp}",
                 f"zero{self.zero}", f"mb{self.micro_batch}x{self.grad_accum}"]
        if self.pp > 1:
            parts.append(self.schedule + (f"/{self.chunks}" if self.chunks > 1 else ""))
        if self.checkpoint != "none":
            parts.append(f"ckpt:{self.checkpoint}")
        if self.offload != "none":
            parts.append(f"offload:{self.offload}")
        if self.overlap_param_gather:
            parts.append("overlap-gather")
        return " ".join(parts)


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


def memory(shape: ModelShape, layout: Layout, seq: int, dtype: str = "bf16",
           bucket_elements: int = 500_000_000) -> dict[str, int]:
    """Bytes per GPU, by part, on the most loaded rank: model states, activations, buffers; and
    "host" for what offload puts in host memory (per GPU)."""
    L = layout
    states = model_state_bytes(shape, dp=L.dp, tp=L.tp, pp=L.pp, stage=L.zero, dtype=dtype,
                               offload_optimizer=L.offload != "none" and L.zero > 0,
                               offload_param=L.offload == "optimizer+param" and L.zero == 3)
    host = states.pop("host", 0)
    states.pop("total")
    if host:  # what lives on the host is not GPU memory
        shard = _shard(shape, L)
        states["grads"] -= 4 * shard  # the masters' fp32 gradients
        states["master_weights"] = states["optimizer"] = 0
        if L.offload == "optimizer+param" and L.zero == 3:
            states["params"] -= (4 if dtype == "fp32" else 2) * shard
    out = dict(states)
    out["activations"] = _activations(shape, L, seq, dtype)
    out["buffers"] = _buffers(shape, L, seq, dtype, bucket_elements)
    out["total"] = sum(out.values())
    out["host"] = host
    return out


def _shard(shape: ModelShape, L: Layout) -> int:
    """Parameters in this rank's data-parallel shard (largest pipeline stage)."""
    stage_params = -(-shape.parameters // (L.tp * L.pp))
    return -(-stage_params // L.dp)


def _activations(shape: ModelShape, L: Layout, seq: int, dtype: str) -> int:
    """Activations alive at the peak: one micro-batch without pipelining, the schedule's
    micro-batches in flight on each stage with it (the larger of the first and last stage)."""
    kw = dict(dtype=dtype, tp=L.tp, sp=L.sequence_parallel, partition_activations=L.checkpoint != "none" and L.tp > 1)
    policy = L.checkpoint
    if L.pp == 1:
        return activation_bytes(shape, L.micro_batch, seq, policy, **kw)
    chunk_layers = -(-shape.layers // (L.pp * L.chunks))
    flight = in_flight(L.schedule, L.pp, L.grad_accum, L.chunks)
    per_chunk = activation_bytes(shape, L.micro_batch, seq, policy, layers=chunk_layers, first_stage=False,
                                 last_stage=False, **kw)
    embedding = activation_bytes(shape, L.micro_batch, seq, policy, layers=0, last_stage=False, **kw)
    head = activation_bytes(shape, L.micro_batch, seq, policy, layers=0, first_stage=False, **kw)
    first = flight[0] * (per_chunk + embedding)
    last = flight[-1] * (per_chunk + head)
    return max(first, last)


def _buffers(shape: ModelShape, L: Layout, seq: int, dtype: str, bucket_elements: int) -> int:
    """Transient buffers: ZeRO-2/3's gradient bucket in flight (two, while the previous one
    reduces), ZeRO-3's gathered layers (the one running and the one prefetched), pipeline
    send/receive buffers, and the logits' gradient in the head's backward."""
    b, a = (4 if dtype == "fp32" else 2), bytes_per_activation(dtype)
    layer = sum(n for where, n, _ in shape.tensors() if where == "block") // shape.layers // L.tp
    stage_params = shape.parameters // (L.tp * L.pp)
    out = 0
    if L.zero >= 2 and L.dp > 1:
        out += 2 * b * min(bucket_elements, stage_params)
    if L.zero == 3:
        out += 2 * b * layer
    tokens = L.micro_batch * seq
    if L.pp > 1:
        out += 2 * 2 * a * tokens * shape.hidden
    out += 4 * tokens * shape.vocab // L.tp
    return out


# ---- time ---------------------------------------------------------------------------------------
def _ring(bytes_: float, n: int, bw_gbps: float, latency_us: float, passes: int, messages: int = 1) -> float:
    """Ring collective over n ranks moving `bytes_` in `messages` calls: `passes` = 2 for
    all-reduce, 1 for reduce-scatter or all-gather; each call pays n - 1 latencies per pass."""
    if n <= 1:
        return 0.0
    return passes * ((n - 1) / n * bytes_ / (bw_gbps * 1e9) + messages * (n - 1) * latency_us * 1e-6)


def _group_link(hw: Hardware, span: int, members_per_node: int) -> tuple[float, float]:
    """Bandwidth and latency of a group whose ranks span `span` consecutive GPUs."""
    if span <= hw.gpus_per_node:
        return hw.intra_gbps, hw.intra_latency_us
    return min(hw.intra_gbps, hw.inter_gbps * max(1, members_per_node)), hw.inter_latency_us


def step_time(shape: ModelShape, layout: Layout, seq: int, hw: Hardware, dtype: str = "bf16",
              bucket_elements: int = 500_000_000) -> dict[str, float]:
    """Seconds per optimizer step, by part; "total" is their sum (each part is what is not hidden)."""
    L = layout
    b, a = (4 if dtype == "fp32" else 2), bytes_per_activation(dtype)
    m = L.grad_accum
    tokens_micro = L.micro_batch * seq
    fpt = shape.flops_per_token(seq)
    block_flops = 6 * (shape.parameters - shape.vocab * shape.hidden * (1 if shape.tied else 2)) \
        + 12 * shape.layers * shape.hidden * seq
    recompute = {"none": 0.0, "every_block": block_flops / 3,
                 "selective": 4 * shape.layers * shape.hidden * seq}[L.checkpoint]
    width = shape.hidden / L.tp
    rate = hw.peak_flops * hw.efficiency * width / (width + hw.knee)
    micro_compute = tokens_micro * (fpt + recompute) / (L.tp * L.pp) / rate

    # Tensor parallelism: per layer and micro-batch, two all-reduces forward and two backward
    # (two more when a checkpointed forward is recomputed); sequence parallelism moves the same
    # bytes as all-gathers and reduce-scatters. Not overlapped with compute.
    tp_bw, tp_lat = _group_link(hw, L.tp, L.tp)
    per_layer = (4 + (2 if L.checkpoint == "every_block" else 0)) * _ring(a * tokens_micro * shape.hidden, L.tp,
                                                                             tp_bw, tp_lat, 2)
    micro_tp = per_layer * shape.layers / L.pp
    micro_stage = micro_compute + micro_tp
    # Pipeline: m micro-batches through p stages; idle fill and drain of (p - 1) / v stage-steps.
    pipeline = micro_stage * (m + (L.pp - 1) / L.chunks)
    out = {"compute": micro_compute * m, "tensor_parallel": micro_tp * m, "bubble": pipeline - micro_stage * m}
    # Pipeline transfers during fill and drain sit on the critical path; in steady state they overlap.
    pp_bw, pp_lat = _group_link(hw, L.gpus, 1) if L.pp > 1 else (1.0, 0.0)
    p2p = a * tokens_micro * shape.hidden / (pp_bw * 1e9) + pp_lat * 1e-6
    out["pipeline_p2p"] = 2 * (L.pp - 1) * L.chunks * p2p if L.pp > 1 else 0.0

    # Data parallelism over the stage's parameters on this GPU.
    psi = shape.parameters / (L.tp * L.pp)
    dp_bw, dp_lat = _group_link(hw, L.dp * L.tp, hw.gpus_per_node // L.tp)
    backward = micro_compute * 2 / 3
    buckets = -(-int(psi) // bucket_elements)
    if L.zero <= 1:      # one reduction at the boundary, overlapped with the last backward (not in pipelines)
        reduce = _ring(b * psi, L.dp, dp_bw, dp_lat, 2 if L.zero == 0 else 1, buckets)
        hidden = backward if L.pp == 1 else 0.0
        exposed = max(0.0, reduce - hidden)
    elif L.zero == 2:    # every micro-batch's gradients reduce-scattered during its backward
        reduce = _ring(b * psi, L.dp, dp_bw, dp_lat, 1, buckets)
        exposed = m * max(0.0, reduce - backward)
    else:                # ZeRO-3: each layer gathered for its forward and its backward (prefetched), and the
        # gradients reduce-scattered, all on the same link under the same micro-batch's compute. A
        # layer whose backward comes within stage3_max_reuse_distance elements of its forward (the
        # last ones: 2 x the parameters after it come between) stays gathered: no second gather.
        kept = min(1.0, STAGE3_MAX_REUSE_DISTANCE / (2 * psi))
        traffic = _ring(b * psi, L.dp, dp_bw, dp_lat, 1, buckets) + \
            (2 - kept) * _ring(b * psi, L.dp, dp_bw, dp_lat, 1, shape.layers // L.pp)
        if L.offload == "optimizer+param":
            traffic += 2 * b * psi / L.dp / (hw.pcie_gbps * 1e9)
        exposed = m * max(0.0, traffic - micro_compute)
    gather_after_step = _ring(b * psi, L.dp, dp_bw, dp_lat, 1, buckets) if L.zero in (1, 2) else 0.0
    if L.overlap_param_gather:  # waited on bucket by bucket in the next forward: exposed beyond it only
        gather_after_step = max(0.0, gather_after_step - micro_compute / 3)
    out["data_parallel"] = exposed + gather_after_step

    # The optimizer step: bound by device memory bandwidth, or by the host's CPU Adam plus PCIe.
    shard = psi / (L.dp if L.zero > 0 else 1)
    if L.offload != "none" and L.zero > 0:
        out["optimizer"] = shard / (hw.host_adam_gparams * 1e9) + (4 + b) * shard / (hw.pcie_gbps * 1e9)
    else:
        out["optimizer"] = (4 * 4 + 4 * 2 + b) * shard / (hw.hbm_gbps * 1e9)
    out["total"] = sum(out.values())
    return out


def throughput(shape: ModelShape, layout: Layout, seq: int, hw: Hardware, dtype: str = "bf16") -> dict[str, float]:
    """Tokens per second of the whole job, and MFU (6N + 12·L·d·s per token, over bf16 peak)."""
    t = step_time(shape, layout, seq, hw, dtype)
    tokens = layout.dp * layout.micro_batch * layout.grad_accum * seq
    tps = tokens / t["total"]
    return {"step_s": t["total"], "tokens_per_s": tps,
            "mfu": tps * shape.flops_per_token(seq) / (layout.gpus * hw.peak_flops), "time": t}


def fits(mem: dict[str, int], hw: Hardware, gpus_per_node: int | None = None) -> str | None:
    """Why the layout does not fit, or None."""
    usable = (hw.memory_gib - hw.reserve_gib) * GIB
    if mem["total"] > usable:
        return f"needs {mem['total'] / GIB:.1f} GiB per GPU, {hw.memory_gib - hw.reserve_gib:.0f} usable"
    per_node = gpus_per_node or hw.gpus_per_node
    if mem["host"] * per_node > hw.host_gib * GIB * 0.9:
        return f"offload needs {mem['host'] * per_node / GIB:.0f} GiB of host memory per node, {hw.host_gib:.0f} there"
    return None
