"""The search: every valid layout for a model on N GPUs, costed, ranked by predicted tokens/s.

Valid means what the engine runs: tensor parallelism inside a node and dividing the heads,
pipeline stages no more than layers (and without ZeRO-3 or sequence parallelism), the global
batch split evenly over data-parallel ranks and micro-batches, offload only with ZeRO. A mixture of
experts adds expert parallelism: ep of each run of data-parallel ranks, ep dividing dp and the experts,
only without tensor, pipeline or sequence splits (the engine's rule); its experts are no tensor-parallel
block, so tensor parallelism runs without sequence parallelism there (the engine refuses the pair).

Splitting each sequence (Ulysses x ring, `sequence_splits`) is a memory saver like checkpointing and
offload, and costs communication: by default ("auto") the search adds those layouts when every layout
without them that fits needs recomputation or offload, or none fits; "always" adds them anyway,
"never" leaves them out.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from ..long_context.layout import SequenceSplit
from .cost import fits, memory, throughput
from .hardware import Hardware
from .layout import EXPERT_IMBALANCE, Layout
from .model import ModelShape

CHECKPOINTS = ("none", "selective", "every_block")
SEQUENCE_SPLITS = ("auto", "always", "never")


@dataclass
class Candidate:
    layout: Layout
    memory: dict[str, int]
    speed: dict
    rejected: str | None  # why it does not fit; None when it does

    @property
    def tokens_per_s(self) -> float:
        return self.speed["tokens_per_s"]


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def expert_splits(shape: ModelShape, dp: int, tp: int, pp: int, sequence_ranks: int) -> list[int]:
    """The expert-parallel sizes to try: 1, and for a mixture of experts on data parallelism alone every
    divisor of dp that divides the number of experts (the engine composes ep with nothing else yet;
    lifting that is this condition)."""
    if not shape.experts or tp * pp * sequence_ranks > 1:
        return [1]
    return [ep for ep in _divisors(dp) if shape.experts % ep == 0]


def sequence_splits(shape: ModelShape, gpus: int, gpus_per_node: int, seq: int, tp: int, pp: int):
    """The (ulysses, ring) sizes that split each sequence, (1, 1) left out: Ulysses sizes dividing the
    query and the key/value heads (each rank attends with whole heads) within a node (its all-to-alls run
    among neighbours), ring sizes powers of two, and a sequence the split can cut (layout.py's rule)."""
    # The engine refuses a split sequence with tensor or pipeline parallelism (config/core.py). The cost
    # model already takes them together (compute over tp·pp·u·c, the heads split by tp before Ulysses),
    # so lifting that restriction is lifting this condition.
    if tp > 1 or pp > 1:
        return []
    out = []
    for u in _divisors(math.gcd(shape.heads // tp, shape.kv_heads // tp)):
        c = 1
        while u <= gpus_per_node // tp and u * c * tp * pp <= gpus:
            if u * c > 1 and gpus % (u * c * tp * pp) == 0 and seq % SequenceSplit(sp=u, cp=c).multiple() == 0:
                out.append((u, c))
            c *= 2
    return out


def layouts(
    shape: ModelShape,
    gpus: int,
    gpus_per_node: int,
    global_batch: int,
    max_micro_batch: int = 16,
    zero_stages=(0, 1, 2, 3),
    offload: bool = True,
    seq: int | None = None,
    split: bool = False,
    expert_imbalance: float = EXPERT_IMBALANCE,
):
    """Every valid layout; with `split`, only those splitting each sequence (of `seq` tokens);
    `expert_imbalance`: a mixture's busiest expert-parallel rank's load over the mean."""
    if split and not seq:
        raise ValueError("the layouts that split each sequence depend on its length: give seq")
    for tp in _divisors(min(gpus, gpus_per_node)):
        if gpus % tp or shape.heads % tp or shape.kv_heads % tp:
            continue
        for pp, u, c in (
            (pp, u, c)
            for pp in _divisors(gpus // tp)
            for u, c in (sequence_splits(shape, gpus, gpus_per_node, seq, tp, pp) if split else [(1, 1)])
        ):
            # (no pipelines of mixtures: the reference MoE's pipeline form would drop its load-balancing
            # loss, so the engine refuses it, and Transformers' MoE families have none)
            if pp > shape.layers or (pp > 1 and shape.experts):
                continue
            dp = gpus // (tp * pp * u * c)
            if global_batch % dp:
                continue
            per_rank = global_batch // dp
            for micro in _divisors(per_rank):
                if micro > max_micro_batch:
                    break
                accum = per_rank // micro
                for zero in zero_stages:
                    if (pp > 1 and zero == 3) or (dp * u * c == 1 and zero == 2):
                        continue  # (one rank holding the parameters: stage 2's gradient shard is the whole gradient)
                    offloads = (
                        ["none"]
                        + (["optimizer"] if offload and zero > 0 else [])
                        + (["optimizer+param"] if offload and zero == 3 else [])
                    )
                    schedules = (
                        [("1f1b", 1)]
                        if pp == 1
                        else [("1f1b", 1)]
                        + ([("interleaved", 2)] if accum % pp == 0 and shape.layers % (2 * pp) == 0 else [])
                    )
                    for ckpt, off, (schedule, chunks), ep in itertools.product(
                        CHECKPOINTS, offloads, schedules, expert_splits(shape, dp, tp, pp, u * c)
                    ):
                        yield Layout(
                            dp=dp,
                            tp=tp,
                            pp=pp,
                            zero=zero,
                            micro_batch=micro,
                            grad_accum=accum,
                            checkpoint=ckpt,
                            offload=off,
                            schedule=schedule,
                            chunks=chunks,
                            sequence_parallel=tp > 1 and pp == 1 and not shape.experts,
                            overlap_param_gather=zero in (1, 2) and pp == 1 and dp * u * c > 1,
                            ulysses=u,
                            ring=c,
                            ep=ep,
                            expert_imbalance=expert_imbalance,
                        )


def plan(
    shape: ModelShape,
    gpus: int,
    hw: Hardware,
    seq: int,
    global_batch: int,
    dtype: str = "bf16",
    gpus_per_node: int | None = None,
    sequence_splits: str = "auto",
    **options,
) -> list[Candidate]:
    """Every valid layout, costed: those that fit first (fastest first), then the rest (fastest first).
    `sequence_splits`: "auto", "always" or "never" (the module's docstring)."""
    if gpus < 1 or global_batch < 1 or seq < 1:
        raise ValueError("gpus, global batch and sequence length must be positive")
    if sequence_splits not in SEQUENCE_SPLITS:
        raise ValueError(f"sequence_splits is one of {', '.join(SEQUENCE_SPLITS)}, not {sequence_splits!r}")
    per_node = gpus_per_node or hw.gpus_per_node

    def costed(split: bool) -> list[Candidate]:
        out = []
        for layout in layouts(shape, gpus, per_node, global_batch, seq=seq, split=split, **options):
            mem = memory(shape, layout, seq, dtype)
            out.append(Candidate(layout, mem, throughput(shape, layout, seq, hw, dtype), fits(mem, hw, per_node)))
        return out

    out = costed(False)
    # (a split is a memory saver: weighed where the other savers are needed)
    plain = [c for c in out if c.rejected is None and c.layout.checkpoint == "none" and c.layout.offload == "none"]
    if sequence_splits == "always" or (sequence_splits == "auto" and not plain):
        out += costed(True)
    if not out:
        raise ValueError(
            f"no layout splits a global batch of {global_batch} over {gpus} GPUs with this model "
            f"({shape.heads} heads, {shape.layers} layers); choose a batch divisible by the GPU count"
        )
    out.sort(key=lambda c: (c.rejected is not None, -c.tokens_per_s, c.memory["total"]))
    return out


def deepspeed_config(layout: Layout, global_batch: int, dtype: str = "bf16", lr: float = 3e-4) -> dict:
    """The DeepSpeed-style JSON config that runs `layout` (zerotron train / initialize)."""
    zero: dict = {"stage": layout.zero}
    if layout.offload != "none":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if layout.offload == "optimizer+param":
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    if layout.overlap_param_gather:
        zero["overlap_param_gather"] = True
    config = {
        "train_batch_size": global_batch,
        "train_micro_batch_size_per_gpu": layout.micro_batch,
        "gradient_accumulation_steps": layout.grad_accum,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}},
        "zero_optimization": zero,
        "tensor_parallel": {"autotp_size": layout.tp},
        "zerotron": {"sequence_parallel": layout.sequence_parallel, "checkpoint_policy": layout.checkpoint},
    }
    if layout.ulysses > 1:
        config["sequence_parallel_size"] = layout.ulysses
    if layout.ring > 1:
        config["zerotron"]["context_parallel_size"] = layout.ring
    if layout.ep > 1:
        config["expert_parallel"] = {"enabled": True, "autoep_size": layout.ep}
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    elif dtype == "fp16":
        config["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}
    if layout.pp > 1:
        config["pipeline"] = {"stages": layout.pp, "schedule": layout.schedule}
    if layout.checkpoint != "none" and layout.tp > 1:
        config["activation_checkpointing"] = {"partition_activations": True}
    return config
