"""A training layout, as the planner costs it: how the GPUs split the work (dp x tp x pp, each sequence
over Ulysses x ring ranks, a mixture's experts over expert-parallel ranks, ZeRO stage, pipeline schedule
and chunks, micro-batches) and the memory savers used (checkpointing, offload)."""

from __future__ import annotations

from dataclasses import dataclass

from ..config import ZeroConfig, ZerotronConfig

STAGE3_MAX_REUSE_DISTANCE = ZeroConfig.stage3_max_reuse_distance  # the config's default, which zero/stage3.py applies
CHECKPOINT_EVERY = ZerotronConfig.checkpoint_every  # the every_k policy's k: the config's default
# The busiest expert-parallel rank's rows over the mean (an assumption, like a capacity factor: routing
# that a load-balancing loss keeps near uniform, with some skew left)
EXPERT_IMBALANCE = 1.25


@dataclass(frozen=True)
class Layout:
    """One training configuration: how the GPUs split the work, and the memory savers used."""

    dp: int
    tp: int = 1
    pp: int = 1
    zero: int = 1
    micro_batch: int = 1
    grad_accum: int = 1  # micro-batches per step on each data-parallel rank
    checkpoint: str = "none"  # none | selective | every_block | every_k | op_sac (torchtitan's)
    offload: str = "none"  # none | optimizer | optimizer+param
    schedule: str = "1f1b"  # gpipe | 1f1b | interleaved (pp > 1)
    chunks: int = 1  # virtual stages per rank (interleaved)
    sequence_parallel: bool = False
    overlap_param_gather: bool = False  # ZeRO-1/2: the step's all-gather hidden under the next forward
    # How the engine runs the layout (zerotron's engine is the default; published engines differ):
    tp_overlap: bool = False  # TP collectives pipelined with the GEMMs (Megatron-Core, async TP)
    flash_attention: bool = True  # False: the s x s attention scores go through device memory
    zero3_regather: bool = False  # ZeRO-3 releases per sub-module (DeepSpeed, reuse.py): recomputation regathers
    pooled_nics: bool = True  # False: each GPU's data-parallel traffic leaves through its own NIC
    # ZeRO-3's stage3_max_reuse_distance (elements): zerotron's engine measures it per layer, DeepSpeed's
    # (zero3_regather) per sub-module
    stage3_max_reuse_distance: float = STAGE3_MAX_REUSE_DISTANCE
    # zerotron's own options (overlap.py plays them out):
    stage3_prefetch: int = 50_000_000  # ZeRO-3: elements gathered ahead of use (stage3_prefetch_bucket_size)
    # ZeRO-3's stage3_max_live_parameters: no cap by default (a config for the layout raises it until it does
    # not bind); 1e9, the config's default, stops prefetching where the root unit or a layer is that large
    stage3_max_live: float = float("inf")
    tp_overlap_comm: bool = False  # tensor_parallel.tp_overlap_comm: each block in two halves of the batch
    # Each sequence split over ulysses x ring ranks (sequence_parallel_size, zerotron.context_parallel_size;
    # topology pp x dp x cp x sp x tp): they read the same samples, so dp alone sets the batch, and they
    # hold the same parameters, so ZeRO shards over dp x ulysses x ring (`replicas`)
    ulysses: int = 1  # Ulysses: all-to-alls trade the sequence split for a head split around attention
    ring: int = 1  # ring attention: key/value blocks passed around the ring, causal halves load-balanced
    # A mixture's experts split over runs of `ep` consecutive data-parallel ranks (expert_parallel.autoep_size),
    # which trade each token's routes by all-to-all; the busiest rank's expert rows are `expert_imbalance`
    # times the mean (planner/experts.py)
    ep: int = 1
    expert_imbalance: float = EXPERT_IMBALANCE

    def __post_init__(self):
        if self.ep < 1 or self.dp % self.ep:
            raise ValueError(f"ep ({self.ep}) must divide dp ({self.dp}): the experts split over data-parallel ranks")
        if self.ep > 1 and self.tp * self.pp * self.sequence_ranks > 1:
            raise ValueError(
                f"expert parallelism (ep {self.ep}) runs with data parallelism only, as the engine does: set tp, pp, "
                "ulysses and ring to 1, or ep to 1"
            )
        if self.expert_imbalance < 1:
            raise ValueError(
                f"expert_imbalance ({self.expert_imbalance}) is the busiest rank's load over the mean: >= 1"
            )

    @property
    def sequence_ranks(self) -> int:
        """The ranks each sequence is split over: each holds 1/sequence_ranks of its tokens."""
        return self.ulysses * self.ring

    @property
    def replicas(self) -> int:
        """The ranks holding the same parameters: ZeRO's group, over which gradients are averaged."""
        return self.dp * self.sequence_ranks

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.pp * self.sequence_ranks

    def describe(self) -> str:
        parts = [
            f"dp{self.dp}",
            *([f"ep{self.ep}"] if self.ep > 1 else []),
            f"tp{self.tp}{'+sp' if self.sequence_parallel else ''}",
            f"pp{self.pp}",
            *([f"u{self.ulysses}"] if self.ulysses > 1 else []),
            *([f"cp{self.ring}"] if self.ring > 1 else []),
            f"zero{self.zero}",
            f"mb{self.micro_batch}x{self.grad_accum}",
        ]
        if self.pp > 1:
            parts.append(self.schedule + (f"/{self.chunks}" if self.chunks > 1 else ""))
        if self.checkpoint != "none":
            parts.append(f"ckpt:{self.checkpoint}")
        if self.offload != "none":
            parts.append(f"offload:{self.offload}")
        if self.overlap_param_gather:
            parts.append("overlap-gather")
        parts += [
            name
            for name, on in (
                ("tp-overlap", self.tp_overlap),
                ("scores-in-hbm", not self.flash_attention),
                ("regather", self.zero3_regather),
                ("nic-per-gpu", not self.pooled_nics),
            )
            if on
        ]
        if self.tp_overlap_comm:
            parts.append("tp-halves")
        if self.ep > 1 and self.expert_imbalance != EXPERT_IMBALANCE:
            parts.append(f"imbalance:{self.expert_imbalance:g}")
        if self.zero == 3 and self.stage3_prefetch != 50_000_000:
            parts.append(f"prefetch:{self.stage3_prefetch:g}")
        if self.zero == 3 and self.stage3_max_reuse_distance != STAGE3_MAX_REUSE_DISTANCE:
            parts.append(f"reuse:{self.stage3_max_reuse_distance:g}")
        return " ".join(parts)
