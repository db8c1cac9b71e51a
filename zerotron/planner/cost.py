"""The cost model: memory per GPU (footprint.py, re-exported here) and time per step of one training
layout.

Time is compute (FLOPs at the hardware's calibrated efficiency, recomputation included) stretched by
the pipeline bubble, plus the communication the engine cannot hide behind compute, from an alpha-beta
model per link level.
"""

from __future__ import annotations

from .activations import bytes_per_activation
from .experts import expert_flops, expert_time
from .footprint import fits, in_flight, memory  # noqa: F401 (the cost model's public face, with time)
from .hardware import Hardware
from .layout import CHECKPOINT_EVERY, Layout
from .model import ModelShape
from .overlap import added_time, grad_buckets, timeline, zero3_forward
from .reuse import gathered
from .sequence import sequence_time


# ---- time ---------------------------------------------------------------------------------------
def _ring(bytes_: float, n: int, bw_gbps: float, latency_us: float, passes: int, messages: int = 1) -> float:
    """Ring collective over n ranks moving `bytes_` in `messages` calls: `passes` = 2 for
    all-reduce, 1 for reduce-scatter or all-gather; each call pays n - 1 latencies per pass."""
    if n <= 1:
        return 0.0
    return passes * ((n - 1) / n * bytes_ / (bw_gbps * 1e9) + messages * (n - 1) * latency_us * 1e-6)


def _group_link(hw: Hardware, span: int, members_per_node: int) -> tuple[float, float]:
    """Bandwidth and latency of a group whose ranks span `span` consecutive GPUs: beyond a node, a
    group with k members per node crosses over k NICs (NCCL's rings run through every rail)."""
    if span <= hw.gpus_per_node:
        return hw.intra_gbps, hw.intra_latency_us
    return min(hw.intra_gbps, hw.inter_gbps * max(1, members_per_node)), hw.inter_latency_us


def score_traffic_s(shape: ModelShape, layout: Layout, seq: int, hw: Hardware, recomputed: float) -> float:
    """Seconds per micro-batch the attention scores spend in device memory when they are
    materialized (no FlashAttention): per token, layer and head, s scores of 2 bytes, which the
    unfused kernels of such engines move 13 times forward (the score GEMM writes them; scale, mask
    and softmax read and write; dropout reads, writes and keeps a 1-byte mask; the value GEMM reads)
    and 19 times backward (the mirror image, with the two score-gradient GEMMs each reading), plus a
    forward's 13 again for each recomputed block. Memory-bound, at the device's bandwidth."""
    if layout.flash_attention:
        return 0.0
    per_score = 13 + 19 + 13 * recomputed
    tokens = layout.micro_batch * seq / layout.sequence_ranks  # this rank's queries (over the whole sequence)
    return tokens * shape.layers / layout.pp * shape.heads / layout.tp * seq * per_score / (hw.hbm_gbps * 1e9)


def step_time(
    shape: ModelShape, layout: Layout, seq: int, hw: Hardware, dtype: str = "bf16", bucket_elements: int | None = None
) -> dict[str, float]:
    """Seconds per optimizer step, by part; "total" is their sum (each part is what is not hidden).
    `bucket_elements`: reduce_bucket_size (None: unset, the engine's rule)."""
    L = layout
    b, a = (4 if dtype == "fp32" else 2), bytes_per_activation(dtype)
    m = L.grad_accum
    tokens_micro = L.micro_batch * seq
    if L.sequence_ranks > 1:  # a rank computes for its 1/(u·c) of each sequence (the attention evenly split)
        tokens_micro /= L.sequence_ranks
    fpt = shape.flops_per_token(seq)
    block_flops = (
        6 * (shape.active_parameters - shape.vocab * shape.hidden * (1 if shape.tied else 2))
        + 12 * shape.layers * shape.hidden * seq
    )
    # every_k checkpoints one block in CHECKPOINT_EVERY (the config's default checkpoint_every, and
    # activation_bytes'): those blocks' forwards run again.
    recomputed = {
        "none": 0.0,
        "every_block": 1.0,
        "selective": 0.0,
        "op_sac": 0.0,
        "every_k": -(-shape.layers // CHECKPOINT_EVERY) / shape.layers,
    }[L.checkpoint]
    recompute = block_flops / 3 * recomputed
    if L.checkpoint == "selective":  # the attention's score and softmax recomputed: 4·L·d·s per token,
        # and a mixture's grouped expert GEMMs (no matmul the policy keeps)
        recompute = 4 * shape.layers * shape.hidden * seq + shape.expert_flops_per_token() / 3
    if L.checkpoint == "op_sac":  # torchtitan's op-level policy: every second matmul of a block again
        recompute = 2 * shape.layers * sum(shape.linears()[1::2])
    width = shape.hidden / L.tp
    rate = hw.peak_flops * hw.efficiency * width / (width + hw.knee)
    # A mixture's routed experts (part of the above): whole on every tensor-parallel rank, which runs them
    # on all its tokens, and on the busiest expert-parallel rank `expert_imbalance` times the mean (experts.py)
    experts = expert_flops(shape, L.checkpoint) * (L.expert_imbalance if L.ep > 1 else 1.0)
    dense = fpt + recompute - expert_flops(shape, L.checkpoint)
    micro_compute = tokens_micro * (dense / L.tp + experts) / L.pp / rate

    # Tensor parallelism: per layer and micro-batch an attention and an MLP block, each with one
    # collective forward and one backward (the forward's again when a checkpointed block is
    # recomputed): an all-reduce, or with sequence parallelism an all-gather before the block and a
    # reduce-scatter after it, around the block's compute as the engine issues them (overlap.py).
    micro_tp = _tensor_parallel(shape, L, seq, hw, a, tokens_micro, rate, recomputed) if L.tp > 1 else 0.0
    if L.tp_overlap:  # chunked and pipelined with the GEMMs they feed: exposed only beyond them
        micro_tp = max(0.0, micro_tp - micro_compute)
    micro_scores = score_traffic_s(shape, L, seq, hw, 1.0 if L.checkpoint == "selective" else recomputed)
    # Each sequence split over ranks: Ulysses' all-to-alls among neighbours, the ring's passes between
    # groups of them (sequence.py)
    links = _group_link(hw, L.ulysses * L.tp, hw.gpus_per_node // L.tp), _group_link(hw, L.sequence_ranks * L.tp, 1)
    micro_ulysses, micro_ring = sequence_time(shape, L, seq, hw, a, rate, *links)
    # Expert parallelism: the tokens' all-to-alls among ep consecutive ranks (experts.py)
    near, far = (hw.intra_gbps, hw.intra_latency_us), _group_link(hw, L.ep, 1)  # (far: beyond a node, a GPU's NIC)
    micro_a2a = expert_time(shape, L, tokens_micro, a, hw.gpus_per_node, near, far)
    micro_stage = micro_compute + micro_scores + micro_tp + micro_ulysses + micro_ring + micro_a2a
    # Pipeline: m micro-batches through p stages; idle fill and drain of (p - 1) / v stage-steps.
    pipeline = micro_stage * (m + (L.pp - 1) / L.chunks)
    out = {
        "compute": micro_compute * m,
        "attention_scores": micro_scores * m,
        "tensor_parallel": micro_tp * m,
        "ulysses_all_to_all": micro_ulysses * m,
        "ring_p2p": micro_ring * m,
        "expert_all_to_all": micro_a2a * m,
        "bubble": pipeline - micro_stage * m,
    }
    # Pipeline transfers during fill and drain sit on the critical path; in steady state they overlap.
    pp_bw, pp_lat = _group_link(hw, L.gpus, 1) if L.pp > 1 else (1.0, 0.0)
    p2p = a * tokens_micro * shape.hidden / (pp_bw * 1e9) + pp_lat * 1e-6
    out["pipeline_p2p"] = 2 * (L.pp - 1) * L.chunks * p2p if L.pp > 1 else 0.0

    # Data parallelism over the stage's parameters on this GPU, among every rank holding them (the
    # sequence ranks too: ZeRO shards over them and gradients are averaged over them); a rank's experts
    # under expert parallelism among the n/ep ranks holding the same ones, ep apart.
    psi = shape.parameters / (L.tp * L.pp)
    n = L.replicas
    dp_bw, dp_lat = _group_link(hw, n * L.tp, hw.gpus_per_node // L.tp if L.pooled_nics else 1)
    edp = _group_link(hw, n, max(1, hw.gpus_per_node // L.ep) if L.pooled_nics else 1)

    def reduction(bucket, passes: int) -> float:
        if bucket.expert:
            return _ring(b * bucket.elements, n // L.ep, *edp, passes)
        return _ring(b * bucket.elements, n, dp_bw, dp_lat, passes)

    backward = micro_compute * 2 / 3
    buckets = grad_buckets(shape, L.tp, L.pp, seq, bucket_elements, L.ep)
    flops = [k.flops for k in buckets]
    if L.zero <= 2:  # reduced bucket by bucket as backward fills them (overlap.py), at the boundary
        costs = [reduction(k, 2 if L.zero == 0 else 1) for k in buckets]
        if L.pp > 1 and L.zero <= 1:  # a pipeline reduces after its last backward: nothing hides it
            exposed = sum(costs)
        else:  # (ZeRO-2: every micro-batch; stages 1-2: one bucket in flight)
            segments = [backward * f / (sum(flops) or 1.0) for f in flops]
            finish = timeline(segments, post=costs, in_flight=None if L.zero == 0 else 1)
            exposed = (m if L.zero == 2 else 1) * added_time(finish, backward, sum(costs), hw.overlap)
    else:  # ZeRO-3: each layer gathered for its forward and its backward (prefetched), its
        # gradients reduce-scattered after its backward (overlap.py)
        exposed = m * _stage3(shape, L, seq, hw, b, tokens_micro, rate, recompute, (dp_bw, dp_lat), edp)
    gather_after_step = 0.0
    if L.zero in (1, 2):  # the step's all-gather, bucket by bucket
        costs = [reduction(k, 1) for k in buckets]
        gather_after_step = sum(costs)
        if L.overlap_param_gather:  # all issued at the step, each waited on at its first use in the next forward
            forward = micro_compute / 3
            segments = [forward * f / (sum(flops) or 1.0) for f in reversed(flops)]
            finish = timeline(segments, pre=costs[::-1], ahead=None)
            gather_after_step = added_time(finish, forward, sum(costs), hw.overlap)
    out["data_parallel"] = exposed + gather_after_step

    # The optimizer step: bound by device memory bandwidth, or by the host's CPU Adam plus PCIe.
    shard = psi / (n if L.zero > 0 else 1)
    if L.offload != "none" and L.zero > 0:
        out["optimizer"] = shard / (hw.host_adam_gparams * 1e9) + (4 + b) * shard / (hw.pcie_gbps * 1e9)
    else:
        out["optimizer"] = (4 * 4 + 4 * 2 + b) * shard / (hw.hbm_gbps * 1e9)
    out["total"] = sum(out.values())
    return out


def _block_flops(shape: ModelShape, seq: int) -> dict[str, float]:
    """Forward FLOPs per token of one layer's attention block (projections and attention) and MLP (a
    mixture's: its router and the top_k experts and shared MLP a token runs)."""
    d, kv = shape.hidden, shape.hidden // shape.heads * shape.kv_heads
    return {
        "attention": 2 * (2 * d * d + 2 * d * kv) + 4 * seq * d,
        "mlp": 2 * shape.mlp_matrices * d * shape.mlp_width + 2 * d * shape.experts,
    }


def _tensor_parallel(
    shape: ModelShape, L: Layout, seq: int, hw: Hardware, a: int, tokens: int, rate: float, recomputed: float
) -> float:
    """What the blocks' tensor-parallel collectives add to one micro-batch on one pipeline stage:
    per block and direction, the block as one segment, or with tp_overlap_comm two halves, each
    half's exit (forward) or entry (backward) collective issued as it ends and, with sequence
    parallelism, both halves' gathers issued at the start (parallel/overlap.py). A mixture's MLP is
    no tensor-parallel block: every rank runs it whole, with no collective."""
    bw, lat = _group_link(hw, L.tp, L.tp)
    halves = 2 if L.tp_overlap_comm and L.micro_batch >= 2 else 1
    act = a * tokens * shape.hidden / halves
    gather = _ring(act, L.tp, bw, lat, 1) if L.sequence_parallel else 0.0
    scatter = _ring(act, L.tp, bw, lat, 1 if L.sequence_parallel else 2)
    forwards = 1 + recomputed  # checkpointed blocks run their forward again
    per_layer = 0.0
    for part, flops in _block_flops(shape, seq).items():
        if part == "mlp" and shape.experts:
            continue
        forward = tokens * flops / L.tp / rate
        for compute, times in ((forward, forwards), (2 * forward, 1)):
            finish = timeline([compute / halves] * halves, pre=[gather] * halves, post=[scatter] * halves, ahead=None)
            per_layer += times * added_time(finish, compute, halves * (gather + scatter), hw.overlap)
    return per_layer * shape.layers / L.pp


def _stage3(
    shape: ModelShape,
    L: Layout,
    seq: int,
    hw: Hardware,
    b: int,
    tokens: int,
    rate: float,
    recompute: float,
    link: tuple[float, float],
    expert_link: tuple[float, float],
) -> float:
    """What ZeRO-3's collectives add to one micro-batch: the root unit (embedding, norm, head)
    gathered as forward starts, each layer's unit gathered `depth` units ahead
    (stage3_prefetch_bucket_size) for its forward and again for its backward unless it is kept
    (stage3_max_reuse_distance, per layer), each unit's gradients reduce-scattered after its
    backward with one reduction in flight (zero/stage3.py). `zero3_regather` (DeepSpeed): what each
    block's forward and backward gather follows DeepSpeed's release per sub-module (reuse.py): a
    checkpointed block's recomputed forward gathers it again, and its backward gathers again the
    linears not reused within the distance. Under expert parallelism a unit's experts (the rank's) are
    gathered among the ranks holding the same ones, over `expert_link`."""
    dense, experts = shape.layer_elements(L.tp, L.ep)
    layer = dense + experts
    root = sum(-(-n // L.tp) if split else n for where, n, split in shape.tensors() if where in ("embed", "head"))
    whole = _ring(b * root, L.replicas, *link, 1)

    def gather(elements: float, expert: float = 0.0) -> float:
        if not elements + expert:
            return 0.0
        time = _ring(b * elements, L.replicas, *link, 1) + _ring(b * expert, L.replicas // L.ep, *expert_link, 1)
        if L.offload == "optimizer+param":  # the shard first crosses PCIe
            time += b * (elements / L.replicas + expert / (L.replicas // L.ep)) / (hw.pcie_gbps * 1e9)
        return time

    unit = gather(dense, experts) if L.ep > 1 else gather(layer)
    ahead, kept = zero3_forward(
        shape.layers, layer, root, L.stage3_prefetch, L.stage3_max_live, L.stage3_max_reuse_distance
    )
    block = (
        tokens * _block_flops(shape, seq)["attention"] / L.tp / rate
        + tokens * _block_flops(shape, seq)["mlp"] / L.tp / rate
    )
    head = tokens * 2 * shape.vocab * shape.hidden / L.tp / rate
    again = tokens * recompute / shape.layers / L.tp / rate  # a checkpointed block's forward in backward
    n = shape.layers
    if L.zero3_regather:  # Megatron's blocks (query_key_value one linear), the engine published with it
        ckpt = tuple(
            L.checkpoint == "every_block" or (L.checkpoint == "every_k" and i % CHECKPOINT_EVERY == 0) for i in range(n)
        )
        linears = tuple(e // L.tp for e in shape.linears(fused_qkv=True))
        first, second = gathered(linears, n, ckpt, L.stage3_max_reuse_distance, root)
        forwards, gathers = [gather(e) for e in first], [gather(e) for e in reversed(second)]
    else:
        forwards, gathers = [unit] * n, [0.0 if i >= n - kept else unit for i in reversed(range(n))]
    forward = timeline([0.0] + [block] * n + [head], pre=[whole] + forwards + [0.0], ahead=ahead + [0])
    # (backward: as deep as the forward's start, where nothing is kept yet)
    backward = timeline(
        [2 * head] + [2 * block + again] * n + [0.0],
        pre=[0.0] + gathers + [0.0],
        post=[0.0] + [unit] * n + [whole],
        ahead=ahead[0],
        in_flight=1,
    )
    compute = 3 * (n * block + head) + n * again
    comm = whole + sum(forwards) + sum(gathers) + n * unit + whole
    return added_time(forward + backward, compute, comm, hw.overlap)


def throughput(shape: ModelShape, layout: Layout, seq: int, hw: Hardware, dtype: str = "bf16") -> dict[str, float]:
    """Tokens per second of the whole job, and MFU (6N + 12·L·d·s per token, over bf16 peak)."""
    t = step_time(shape, layout, seq, hw, dtype)
    tokens = layout.dp * layout.micro_batch * layout.grad_accum * seq  # (a sequence's ranks share its tokens)
    tps = tokens / t["total"]
    return {
        "step_s": t["total"],
        "tokens_per_s": tps,
        "mfu": tps * shape.flops_per_token(seq) / (layout.gpus * hw.peak_flops),
        "time": t,
    }
