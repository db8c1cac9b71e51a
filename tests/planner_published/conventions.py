"""How a published training run is rebuilt as the planner sees it: the Run record, the conversions of each
source's throughput to tokens/s per GPU, shapes and layouts in the sources' terms, and how the published engines
run a layout where they differ from zerotron's. The runs themselves: runs.py and more_runs.py.

Achieved throughput, as tokens/s per GPU, is converted EXACTLY from each source's own convention
(the comment on every row shows the arithmetic); n = GPUs, B = global batch (sequences), s = seq:

    C1  Narayanan et al. 2021, eq. (3), recomputation counted (also BigScience's TFLOPs):
        F = 96·B·s·l·h²·(1 + s/6h + V/16lh) per iteration, per-GPU rate X = F / (T·n), so
        tokens/s/GPU = B·s / (T·n) = X / (96·l·h²·(1 + s/6h + V/16lh))          (B cancels)
    C2  Korthikanti et al. 2022 MFU (no recompute): model FLOPs 72·B·l·s·h²·(1 + s/6h + V/12hl),
        MFU = F / (T·n·peak), so tokens/s/GPU = MFU·peak / (72·l·h²·(1 + s/6h + V/12hl)),
        peak = 312e12 (A100 bf16)
    C4  Llama 3 (PaLM's MFU: 6N + 12·l·h·s per token, no recompute): from the reported model
        TFLOP/s per GPU, tokens/s/GPU = X / (6N + 12·l·h·s), N = all parameters (the paper does
        not say whether embeddings count: about 1% of N at 405B)
    C5, C6  MosaicML llm-foundry and torchtitan report tokens/s per GPU: used as is
    iter    a reported time per iteration T: tokens/s/GPU = B·s / (T·n)

Shapes: GPT-3-style models (Megatron, BLOOM, MPT) are ModelShape(..., ffn=4h, tied=True,
gated=False) with kv_heads = heads; Llama models are gated with their kv heads and ffn. The
planner's shapes are bias-free and RMS-normed; biases and LayerNorm weights are <0.1% of N.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from zerotron.planner.cost import Layout
from zerotron.planner.hardware import hardware
from zerotron.planner.model import ModelShape

A100_PEAK = hardware("a100-80").peak_flops  # the planner's table: 312e12, dense bf16
SEQ_GPT = 2048
V_MEGATRON = 51_200


# ---- conversions (section 2 of the run notes) ---------------------------------------------------
def c1(x_tflops: float, l: int, h: int, s: int = SEQ_GPT, v: int = V_MEGATRON) -> float:
    """Narayanan eq. (3): tokens/s/GPU from achieved TFLOP/s per GPU (recompute counted)."""
    return x_tflops * 1e12 / (96 * l * h * h * (1 + s / (6 * h) + v / (16 * l * h)))


def c2(mfu: float, l: int, h: int, s: int = SEQ_GPT, v: int = V_MEGATRON, peak: float = A100_PEAK) -> float:
    """Korthikanti MFU: tokens/s/GPU from model FLOPs utilisation (no recompute)."""
    return mfu * peak / (72 * l * h * h * (1 + s / (6 * h) + v / (12 * h * l)))


def c4(x_tflops: float, shape: ModelShape, s: int) -> float:
    """Llama 3 / PaLM MFU convention: tokens/s/GPU from model TFLOP/s per GPU, 6N + 12·l·h·s."""
    return x_tflops * 1e12 / (6 * shape.parameters + 12 * shape.layers * shape.hidden * s)


def per_iteration(batch: int, seq: int, seconds: float, gpus: int) -> float:
    """tokens/s/GPU from a reported time per iteration."""
    return batch * seq / (seconds * gpus)


# ---- shapes and layouts -------------------------------------------------------------------------
def gpt(layers: int, hidden: int, heads: int, vocab: int = V_MEGATRON) -> ModelShape:
    """A GPT-3-style shape: 4h two-matrix MLP, multi-head attention, tied embedding."""
    return ModelShape(layers, hidden, heads, heads, 4 * hidden, vocab, tied=True, gated=False)


def layout(
    dp: int,
    tp: int,
    pp: int,
    micro_batch: int,
    global_batch: int,
    *,
    zero: int = 1,
    checkpoint: str = "every_block",
    chunks: int = 1,
    sp: bool = False,
    **engine,
) -> Layout:
    """A Layout from the source's terms: grad_accum = global batch / (dp · micro batch); `engine`:
    the Layout fields saying how the source's engine runs it (below)."""
    accum, rest = divmod(global_batch, dp * micro_batch)
    assert rest == 0 and accum > 0, (dp, micro_batch, global_batch)
    return Layout(
        dp=dp,
        tp=tp,
        pp=pp,
        zero=zero,
        micro_batch=micro_batch,
        grad_accum=accum,
        checkpoint=checkpoint,
        schedule="interleaved" if chunks > 1 else "1f1b",
        chunks=chunks,
        sequence_parallel=sp,
        **engine,
    )


# How the published engines run a layout, where they differ from zerotron's (docs/planner.md):
# Megatron-LM before FlashAttention (2021-22, also under DeepSpeed and BigScience) materializes the
# attention scores: the fused scale-mask-softmax kernel and attention dropout (Megatron's default
# --attention-dropout 0.1, kept by the BLOOM and Azure scripts) read and write them in device memory.
SCORES_IN_HBM = dict(flash_attention=False)
# DeepSpeed ZeRO-3 (0.3 to 0.6): hooks on every sub-module release its parameters after each use
# unless the sub-module runs again within stage3_max_reuse_distance elements (zerotron/planner/
# reuse.py): a checkpointed block's recomputed forward gathers it again, and its backward gathers
# again the linears not reused within that distance. The distance is each run's (its
# stage3_max_reuse_distance field): DeepSpeed's default, 1e9, for Narayanan's runs, whose config is
# not published; 3e9 on Azure (both recipes).
# pooled_nics=False is NOT a property of DeepSpeed: NCCL builds the rings for DeepSpeed and FSDP
# alike. It is a value FITTED to Narayanan's six ZeRO-3 rows (Table 2), whose iterations stay flat
# while compute halves, as if each GPU moved one HDR NIC's worth (21-23 GB/s); the Azure rows reuse
# it. comparison.py reports those six rows apart from the others.
DEEPSPEED_ZERO3 = dict(flash_attention=False, zero3_regather=True, pooled_nics=False)
DEEPSPEED_DEFAULT_REUSE = 1e9  # stage3_max_reuse_distance's default in DeepSpeed 0.3.13 (stage3.py)


def narayanan_chunks(layers: int, pp: int) -> int:
    """Virtual stages per rank for Narayanan's interleaved runs: the paper does not say, so 2,
    or the smallest divisor > 1 of the layers per stage when 2 does not divide them."""
    per = layers // pp
    return next(v for v in range(2, per + 1) if per % v == 0) if pp > 1 and per > 1 else 1


@dataclass
class Run:
    name: str
    source: str
    shape: ModelShape
    seq: int
    gpu: str  # hardware preset
    gpus: int
    layout: Layout
    achieved: float  # tokens/s per GPU, converted from the source's convention
    reported: str  # what the source says, in its own terms
    notes: list[str] = field(default_factory=list)
    family: str = ""  # engine / publication, for the per-family summary
    hw: dict = field(default_factory=dict)  # preset fields the source's machines differ in
