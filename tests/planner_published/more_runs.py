"""The wider set of published runs (issue 19 §5): Narayanan et al.'s 530B rows of Table 2, the
Megatron-Core H100 table, more of torchtitan's benchmarks, and DeepSpeed's ZeRO-3 runs on Azure.
Conventions and helpers: conventions.py. Every figure is quoted from the named file,
and every layout detail the source does not give is stated as an assumption in the row's notes.

    C7  Megatron-Core r0.8.0's FLOP count (megatron/training/training.py, core_v0.8.0,
        num_floating_point_operations; no recomputation counted), per token:
        12·l·h²·((1 + g/a + s/h)·q/h + (f/h)·m + V/(2·l·h)), g kv heads, a heads, q = a·head dim,
        f ffn, m = 3/2 for SwiGLU else 1. For the GPT shapes below (q = h, g = a, f = 4h, m = 1)
        this is C2's 72·l·h²·(1 + s/6h + V/12lh); tokens/s/GPU = X / that.
"""

from __future__ import annotations

from planner_published.conventions import (
    DEEPSPEED_DEFAULT_REUSE,
    DEEPSPEED_ZERO3,
    SCORES_IN_HBM,
    SEQ_GPT,
    Run,
    c1,
    gpt,
    layout,
    narayanan_chunks,
)
from planner_published.runs import OP_SAC_NOTE
from zerotron.planner.model import ARCHITECTURES, ModelShape

NARAYANAN_T2 = "Narayanan et al. SC21, arXiv:2104.04473, Table 2"
MCORE = (
    "NVIDIA/Megatron-LM README.md 'Performance Benchmarking', images/model_table.png "
    "(Megatron-Core r0.8.0, added in commit f2e5db402c, July 2024)"
)
TITAN_A100 = "pytorch/torchtitan docs/performance.md (commit 3faaa1a0d, Aug 2024)"
TITAN_H100 = "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md"
TITAN_ASYNC = "pytorch/torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md"
DS_AZURE = (
    "deepspeedai/DeepSpeed docs/_posts/2022-07-26-deepspeed-azure.md (recipes: deepspeedai/"
    "Megatron-DeepSpeed examples_deepspeed/azure/run-175b.sh, run-1t.sh)"
)
# Meta's Grand Teton H100s (torchtitan's benchmarks): 96 GB of HBM2e at 2.4 TB/s, 400 Gb/s per GPU
# between hosts (the h100 preset's), run at 500 W. Their peak is "between SXM and NVL, and we don't
# know its exact value" (the source's footnote): the SXM figure stays, an upper bound.
GRAND_TETON = {"memory_gib": 96, "hbm_gbps": 2400}
GT_NOTE = "H100 96 GB HBM2e at 500 W (Grand Teton): peak below the SXM 989 TFLOP/s used here (not published)"


def c7(x_tflops: float, shape: ModelShape, s: int) -> float:
    """Megatron-Core's num_floating_point_operations: tokens/s/GPU from TFLOP/s per GPU."""
    l, h, a = shape.layers, shape.hidden, shape.heads
    m = 1.5 if shape.gated else 1.0
    per_token = 12 * l * h * h * ((1 + shape.kv_heads / a + s / h) + shape.ffn / h * m + shape.vocab / (2 * l * h))
    return x_tflops * 1e12 / per_token


def narayanan_530b() -> list[Run]:
    """Table 2's 529.6B rows: PTD-P (model-parallel size 280 = TP8 x PP35) and ZeRO-3 alone."""
    shape, out = gpt(105, 20480, 128), []
    v = narayanan_chunks(105, 35)
    for gpus, x in ((560, 171), (1120, 167), (2240, 159)):
        out.append(
            Run(
                f"GPT 530B PTD-P {gpus}",
                NARAYANAN_T2,
                shape,
                SEQ_GPT,
                "a100-80",
                gpus,
                layout(gpus // 280, 8, 35, 1, 2240, zero=0, chunks=v, **SCORES_IN_HBM),
                c1(x, 105, 20480),  # C1 with l = 105, h = 20480
                f"{x} TFLOP/s/GPU (C1)",
                [
                    "model-parallel size 280 = TP8 x PP35 (Table 1's 529.6B layout)",
                    f"interleaved schedule, virtual stages per rank not given: {v} assumed",
                    "full recomputation",
                    "plain data parallelism (ZeRO-0)",
                ],
                "Megatron-LM 2021 (PTD-P)",
            )
        )
    for gpus, mb, batch, x in ((640, 4, 2560, 138), (1120, 2, 2240, 98), (2240, 1, 2240, 48)):
        out.append(
            Run(
                f"GPT 530B ZeRO-3 {gpus}",
                NARAYANAN_T2 + " (DeepSpeed ZeRO-3)",
                shape,
                SEQ_GPT,
                "a100-80",
                gpus,
                layout(
                    gpus, 1, 1, mb, batch, zero=3, **DEEPSPEED_ZERO3, stage3_max_reuse_distance=DEEPSPEED_DEFAULT_REUSE
                ),
                c1(x, 105, 20480),  # C1 with l = 105, h = 20480
                f"{x} TFLOP/s/GPU (C1)",
                [
                    "DeepSpeed ZeRO-3, no model parallelism; full recomputation",
                    "stage3_max_reuse_distance 1e9 assumed (DeepSpeed's default; config not published)",
                    "pooled_nics=False fitted to Table 2's six ZeRO-3 rows",
                ],
                "DeepSpeed ZeRO-3 2021",
            )
        )
    return out


def megatron_core_h100() -> list[Run]:
    """The weak-scaling table: (label, heads, hidden, layers, tp, pp, global batch, TFLOP/s/GPU, MFU %);
    DP 48 everywhere, vocabulary 131,072, sequence 4096, untied embeddings (the labels' parameter counts)."""
    rows = [
        ("1.7B", 16, 2048, 24, 1, 1, 192, 408.8, 41),
        ("7.1B", 32, 4096, 30, 2, 1, 192, 465.9, 47),
        ("16B", 48, 6144, 32, 4, 1, 192, 489.1, 49),
        ("32B", 56, 7168, 48, 8, 1, 192, 459.6, 46),
        ("70B", 64, 8192, 84, 8, 2, 384, 419.7, 42),
        ("119B", 80, 10240, 92, 8, 4, 768, 420.5, 43),
        ("177B", 96, 12288, 96, 8, 6, 1152, 432.8, 44),
        ("314B", 128, 16384, 96, 8, 8, 1536, 474.4, 48),
        ("462B", 144, 18432, 112, 8, 16, 3072, 459.9, 47),
    ]
    out = []
    for label, heads, h, l, tp, pp, gbs, x, mfu in rows:
        shape = ModelShape(l, h, heads, heads, 4 * h, 131_072, tied=False, gated=False)
        lay = layout(
            48, tp, pp, 1, gbs, zero=1, checkpoint="none", sp=tp > 1, overlap_param_gather=True, tp_overlap=True
        )
        out.append(
            Run(
                f"Megatron-Core GPT-{label}",
                MCORE,
                shape,
                4096,
                "h100",
                48 * tp * pp,
                lay,
                c7(x, shape, 4096),  # C7 = 72·l·h²·(1 + s/6h + V/12lh), s = 4096, V = 131,072
                f"{x} TFLOP/s/GPU, MFU {mfu}% (C7)",
                [
                    "micro batch 1 assumed (not given)",
                    "no recomputation assumed (not given)",
                    "1F1B assumed, not interleaved (not given; 92/4 and 112/16 layers per stage are odd)",
                    "distributed optimizer (= ZeRO-1; --overlap-param-gather requires it)",
                    "sequence parallelism with TP (--tp-comm-overlap requires it)",
                    "TP, DP and PP communication overlapped (--tp-comm-overlap, --overlap-grad-reduce, "
                    "--overlap-param-gather)",
                    "bf16 assumed (the MFU column is TFLOP/s over 989)",
                ],
                "Megatron-Core 2024 (H100)",
            )
        )
    return out


def torchtitan_more() -> list[Run]:
    """FSDP2 (= ZeRO-3), tokens/s per GPU as reported (C6); A100 rows on 64 A100-80GB."""
    l2_13, l2_70, l3_8 = ARCHITECTURES["llama2-13b"], ARCHITECTURES["llama2-70b"], ARCHITECTURES["llama3-8b"]
    layer_note = "selective layer AC = every 2nd layer (torchtitan's default selective_ac_option '2', assumed)"
    out = [
        Run(
            "torchtitan Llama 3 8B, AC every 2nd layer",
            TITAN_A100,
            l3_8,
            8192,
            "a100-80",
            64,
            layout(64, 1, 1, 1, 64, zero=3, checkpoint="every_k"),
            2904,
            "2904 tok/s/GPU, MFU 56.8% (C6)",
            ["FSDP2 = ZeRO-3", layer_note, "seq 8192 (train_configs/llama3_8b.toml)"],
            "torchtitan FSDP2",
        )
    ]
    for name, ckpt, x, mfu in (
        ("no AC", "none", 2162, 61.1),
        ("AC every 2nd layer", "every_k", 1914, 54.1),
        ("selective op AC", "op_sac", 1904, 53.8),
    ):
        out.append(
            Run(
                f"torchtitan Llama 2 13B, {name}",
                TITAN_A100,
                l2_13,
                4096,
                "a100-80",
                64,
                layout(64, 1, 1, 2, 128, zero=3, checkpoint=ckpt),
                x,
                f"{x} tok/s/GPU, MFU {mfu}% (C6)",
                ["FSDP2 = ZeRO-3", "local batch 2, seq 4096 (train_configs/llama2_13b.toml)"]
                + ([layer_note] if ckpt == "every_k" else [OP_SAC_NOTE] if ckpt == "op_sac" else []),
                "torchtitan FSDP2",
            )
        )
    for mb, ckpt, x, mfu in ((1, "op_sac", 355, 50.8), (2, "every_block", 353, 50.5)):
        out.append(
            Run(
                f"torchtitan Llama 2 70B, local batch {mb}",
                TITAN_A100,
                l2_70,
                4096,
                "a100-80",
                64,
                layout(64, 1, 1, mb, 64 * mb, zero=3, checkpoint=ckpt),
                x,
                f"{x} tok/s/GPU, MFU {mfu}% (C6)",
                ["FSDP2 = ZeRO-3", OP_SAC_NOTE if ckpt == "op_sac" else "full AC", "seq 4096"],
                "torchtitan FSDP2",
            )
        )
    return out


def torchtitan_h100() -> list[Run]:
    """bf16 rows only (no Float8); TP in torchtitan shards the norms' sequence too (sequence parallelism)."""
    l3_8, l3_70, l3_405 = ARCHITECTURES["llama3-8b"], ARCHITECTURES["llama3-70b"], ARCHITECTURES["llama3-405b"]
    out = []
    for gpus, eager, compiled in ((8, 5762, 6667), (128, 5605, 6514)):
        for how, x in (("", eager), (", compiled", compiled)):
            out.append(
                Run(
                    f"torchtitan H100 Llama 3.1 8B FSDP {gpus}{how}",
                    TITAN_H100,
                    l3_8,
                    8192,
                    "h100",
                    gpus,
                    layout(gpus, 1, 1, 2, 2 * gpus, zero=3, checkpoint="op_sac"),
                    x,
                    f"{x} TPS/GPU (C6)",
                    [
                        "FSDP2 = ZeRO-3",
                        "local batch 2, selective AC ('op': train_configs/llama3_8b.toml at 9dec370)",
                        OP_SAC_NOTE + "; the same policy at 9dec370",
                        "torch.compile" if how else "eager",
                        GT_NOTE,
                    ],
                    "torchtitan FSDP2 (H100)",
                    GRAND_TETON,
                )
            )
    for size, shape, gpus, mb, ckpt, (vanilla, asyncx) in (
        ("70B", l3_70, 256, 16, "every_block", (597.3, 652.4)),
        ("8B", l3_8, 64, 12, "op_sac", (4378, 4809.4)),
    ):
        for how, x in (("", vanilla), (", async TP", asyncx)):
            out.append(
                Run(
                    f"torchtitan H100 Llama 3.1 {size} FSDP+TP8{how}",
                    TITAN_ASYNC,
                    shape,
                    8192,
                    "h100",
                    gpus,
                    layout(gpus // 8, 8, 1, mb, gpus // 8 * mb, zero=3, checkpoint=ckpt, sp=True, tp_overlap=bool(how)),
                    x,
                    f"{x} tokens/sec (C6)",
                    [
                        "FSDP2 = ZeRO-3 over the data-parallel ranks",
                        f"local batch {mb}",
                        "per GPU INFERRED: the source's header says only 'tokens/sec'; torchtitan logs tokens/s "
                        "per GPU (components/metrics.py at 820504e: a rank's tokens / (time x non-data-parallel "
                        "size)), and the 70B float8 vanilla-TP figure (809.8) is near the 2024 benchmark's "
                        "829 TPS/GPU for the same layout (Table 4)",
                        "full AC"
                        if ckpt == "every_block"
                        else OP_SAC_NOTE + "; the same policy at 820504e "
                        "(its 'per op SAC'); the TP all-gathers it recomputes under sequence parallelism are "
                        "not modelled",
                        "torch.compile, bf16",
                        "seq 8192 (train_configs)",
                        GT_NOTE,
                    ],
                    "torchtitan FSDP2 (H100)",
                    GRAND_TETON,
                )
            )
    out.append(
        Run(
            "torchtitan H100 Llama 3.1 405B FSDP16+TP8",
            "pytorch/torchtitan docs/performance.md (commit 3faaa1a0d)",
            l3_405,
            8192,
            "h100",
            128,
            layout(16, 8, 1, 2, 32, zero=3, sp=True),
            109,
            "109 WPS, MFU 29.0% (C6)",
            ["FSDP2 = ZeRO-3 over the data-parallel ranks", "local batch 2, full AC", "no Float8 or async TP", GT_NOTE],
            "torchtitan FSDP2 (H100)",
            {"memory_gib": 95, "hbm_gbps": 2400},
        )
    )
    return out


def deepspeed_azure() -> list[Run]:
    """DeepSpeed 0.6.2 ZeRO-3, no model parallelism, fp16, on NDm A100 v4 (8 x A100 80 GB, one
    200 Gb/s HDR NIC per GPU: the a100-80 preset; 1.7 TB host). Both recipes set
    stage3_max_reuse_distance 3e9; the optimizer is offloaded where the recipe says so:
    run-175b.sh sets OFFLOAD_DEVICE="none", run-1t.sh "cpu" (its README: "For the 1T model, we have
    also enabled the CPU-offload feature"); the 2T model has no recipe."""
    out = []
    for name, (l, h, heads), s, gpus, mb, x, offload, why in (
        (
            "175B",
            (96, 12288, 96),
            512,
            256,
            32,
            204.49,
            "none",
            'no offload: run-175b.sh\'s OFFLOAD_DEVICE="none" (the recipe runs micro batch 4 at seq 1024; the '
            "post's peak run, micro batch 32 at seq 512, is assumed to keep its offload setting)",
        ),
        (
            "1T",
            (128, 25600, 160),
            1024,
            1024,
            8,
            165.36,
            "optimizer",
            'optimizer offload to CPU: run-1t.sh\'s OFFLOAD_DEVICE="cpu", --cpu-optimizer',
        ),
        (
            "2T",
            (160, 32768, 128),
            1024,
            1024,
            8,
            157.0,
            "optimizer",
            "optimizer offload to CPU assumed as for 1T (no 2T recipe; the post: 'the activation and "
            "optimizer states are allocated in the main memory')",
        ),
    ):
        lay = layout(
            gpus, 1, 1, mb, gpus * mb, zero=3, offload=offload, **DEEPSPEED_ZERO3, stage3_max_reuse_distance=3e9
        )
        out.append(
            Run(
                f"DeepSpeed Azure ZeRO-3 {name}",
                DS_AZURE,
                gpt(l, h, heads, vocab=50_304),
                s,
                "a100-80",
                gpus,
                lay,
                c1(x, l, h, s=s, v=50_304),  # C1 (the post's formula) with its s and V = 50,304
                f"{x} TFLOP/s/GPU (C1)",
                [
                    why,
                    "stage3_max_reuse_distance 3e9 (both recipes)",
                    "activation checkpointing, fp16 (the recipes)",
                    "gradient accumulation 1 assumed (the recipes')",
                    "pooled_nics=False: the value fitted to Narayanan's Table 2, not measured here",
                    "GPT-2 vocabulary padded to 50,304 assumed: under 0.3% of C1",
                ],
                "DeepSpeed ZeRO-3 2022 (Azure)",
                {"host_gib": 1700},
            )
        )
    return out


def wider() -> list[Run]:
    return narayanan_530b() + megatron_core_h100() + torchtitan_more() + torchtitan_h100() + deepspeed_azure()
