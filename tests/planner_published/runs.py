"""Published large training runs, rebuilt as the planner sees them (comparison.py compares them with its
predictions): the 29 runs of the first comparison (Narayanan et al.'s Tables 1 and 2, Korthikanti et al., BLOOM,
MosaicML, torchtitan, Llama 3) and the runs not used (SKIPPED, with the reason for each). The conventions every
row's arithmetic follows, the Run record and the shape and layout helpers: conventions.py.
"""

from __future__ import annotations

from planner_published.conventions import (
    DEEPSPEED_DEFAULT_REUSE,
    DEEPSPEED_ZERO3,
    SCORES_IN_HBM,
    SEQ_GPT,
    Run,
    c1,
    c2,
    c4,
    gpt,
    layout,
    narayanan_chunks,
    per_iteration,
)
from zerotron.planner.model import ARCHITECTURES, ModelShape

NARAYANAN = "Narayanan et al. SC21, arXiv:2104.04473"
NARAYANAN_T1 = f"{NARAYANAN}, Table 1 (micro batch: bigscience-workshop/bigscience experiments/meg-notes.md)"
# The SC21 text (arXiv v5) read for Table 1 gives tensor- and pipeline-parallel sizes, GPUs and batch;
# DP is GPUs / (TP·PP). Micro batches appear only in BigScience's notes, which transcribe an earlier
# version of the table (arXiv v2, one "model parallel size" column, from which BigScience derived TP
# and PP themselves: "So for example for 76B it says MP=32, which means 8 * 4"); their split agrees
# with SC21's columns. The v2 table itself was not read.
NARAYANAN_T1_NOTE = (
    "TP/PP from Table 1 (SC21 text), DP = GPUs / (TP·PP); micro batch {mb} only in BigScience's "
    "meg-notes.md (its transcription of arXiv v2's table, which had one model-parallel column and "
    "from which BigScience derived TP/PP themselves); NVIDIA's SC21 table gives no micro batch"
)
KORTHIKANTI = (
    "Korthikanti et al. 2022, arXiv:2205.05198: configurations Table 3, MFU Table 5, interleaving §6 "
    "(read from a text copy of the paper)"
)
BLOOM = "bigscience-workshop/bigscience train/tr11-176B-ml/README.md + tr11-176B-ml.slurm"
MOSAIC = "mosaicml/llm-foundry scripts/train/benchmarking/README.md (shapes: scripts/train/yamls/pretrain/mpt-*.yaml)"
TITAN = "pytorch/torchtitan docs/performance.md"
LLAMA3 = "Llama 3 Herd of Models, arXiv:2407.21783, Table 4"
MEGATRON_DDP = "Megatron-LM of 2021/22: plain data parallelism, no distributed optimizer (ZeRO-0)"
CHUNKS_NOTE = "interleaved schedule, virtual stages per rank not given: {v} assumed"


def narayanan_table1() -> list[Run]:
    """Table 1: (params label, heads, hidden, layers, tp, pp, dp, micro batch, global batch, TFLOP/s/GPU)."""
    rows = [
        ("1.7B", 24, 2304, 24, 1, 1, 32, 16, 512, 137),
        ("3.6B", 32, 3072, 30, 2, 1, 32, 16, 512, 138),
        ("7.5B", 32, 4096, 36, 4, 1, 32, 16, 512, 142),
        ("18.4B", 48, 6144, 40, 8, 1, 32, 8, 1024, 135),
        ("39.1B", 64, 8192, 48, 8, 2, 32, 4, 1536, 138),
        ("76.1B", 80, 10240, 60, 8, 4, 32, 2, 1792, 140),
        ("145.6B", 96, 12288, 80, 8, 8, 24, 2, 2304, 148),
        ("310.1B", 128, 16384, 96, 8, 16, 15, 1, 2160, 155),
        ("529.6B", 128, 20480, 105, 8, 35, 9, 1, 2520, 163),
        ("1008.0B", 160, 25600, 128, 8, 64, 6, 1, 3072, 163),
    ]
    out = []
    for label, heads, h, l, tp, pp, dp, mb, gbs, x in rows:
        v = narayanan_chunks(l, pp)
        notes = ["full recomputation (eq. 3 assumes it)", MEGATRON_DDP, NARAYANAN_T1_NOTE.format(mb=mb)]
        if pp > 1:
            notes.append(CHUNKS_NOTE.format(v=v) + ("" if v == 2 else f" (2 does not divide {l // pp} layers/stage)"))
        out.append(
            Run(
                f"Megatron GPT-{label}",
                NARAYANAN_T1,
                gpt(l, h, heads),
                SEQ_GPT,
                "a100-80",
                tp * pp * dp,
                layout(dp, tp, pp, mb, gbs, zero=0, chunks=v, **SCORES_IN_HBM),
                # C1: X / (96·l·h²·(1 + s/6h + V/16lh)), s = 2048, V = 51,200
                c1(x, l, h),
                f"{x} TFLOP/s/GPU (C1)",
                notes,
                "Megatron-LM 2021 (PTD-P)",
            )
        )
    return out


def narayanan_table2() -> list[Run]:
    """Table 2: GPT-3 174.6B, global batch 1536; PTD-P (TP8 x PP12) and ZeRO-3 without model parallelism."""
    shape, out = gpt(96, 12288, 96), []
    for gpus, x in ((384, 153), (768, 149), (1536, 141)):
        v = narayanan_chunks(96, 12)
        out.append(
            Run(
                f"GPT-3 175B PTD-P {gpus}",
                f"{NARAYANAN}, Table 2",
                shape,
                SEQ_GPT,
                "a100-80",
                gpus,
                layout(gpus // 96, 8, 12, 1, 1536, zero=0, chunks=v, **SCORES_IN_HBM),
                c1(x, 96, 12288),  # C1 with l = 96, h = 12288
                f"{x} TFLOP/s/GPU (C1)",
                [
                    "model-parallel size 96 = TP8 x PP12 (TP8 from the text, PP derived)",
                    CHUNKS_NOTE.format(v=v),
                    "full recomputation",
                    MEGATRON_DDP,
                ],
                "Megatron-LM 2021 (PTD-P)",
            )
        )
    for gpus, mb, x in ((384, 4, 144), (768, 2, 88), (1536, 1, 44)):
        out.append(
            Run(
                f"GPT-3 175B ZeRO-3 {gpus}",
                f"{NARAYANAN}, Table 2 (DeepSpeed ZeRO-3)",
                shape,
                SEQ_GPT,
                "a100-80",
                gpus,
                layout(
                    gpus, 1, 1, mb, 1536, zero=3, **DEEPSPEED_ZERO3, stage3_max_reuse_distance=DEEPSPEED_DEFAULT_REUSE
                ),
                c1(x, 96, 12288),  # C1 with l = 96, h = 12288
                f"{x} TFLOP/s/GPU (C1)",
                [
                    "DeepSpeed ZeRO-3, no model parallelism; full recomputation",
                    "stage3_max_reuse_distance 1e9 assumed (DeepSpeed's default; config not published)",
                    "pooled_nics=False fitted to this table's six ZeRO-3 rows",
                ],
                "DeepSpeed ZeRO-3 2021",
            )
        )
    return out


def korthikanti() -> list[Run]:
    """Sequence parallelism + selective recomputation, data-parallel size 1. Table 3: (label, layers,
    hidden, heads, pipeline size, global batch, micro batch) with TP 8; §6: interleaved with 3 stages
    for 175B and 530B, s = 2048, V = 51,200; Table 5: MFU (its iteration times give the same
    tokens/s within 0.4%: 1.10, 13.75, 37.83, 71.49 s)."""
    rows = [
        ("22B", 48, 6144, 64, 1, 4, 4, 1, 0.415),
        ("175B", 96, 12288, 96, 8, 64, 1, 3, 0.514),
        ("530B", 105, 20480, 128, 35, 280, 1, 3, 0.560),
        ("1T", 128, 25600, 160, 64, 512, 1, 1, 0.563),
    ]
    out = []
    for label, l, h, heads, pp, gbs, mb, v, mfu in rows:
        notes = ["sequence parallelism + selective recomputation", MEGATRON_DDP]
        notes.append(
            "interleaved, 3 virtual stages per rank (§6)"
            if v > 1
            else "interleaving not stated (§6 names only 175B/530B); 1F1B"
            if pp > 1
            else "no pipeline"
        )
        out.append(
            Run(
                f"Korthikanti GPT-{label}",
                KORTHIKANTI,
                gpt(l, h, heads),
                SEQ_GPT,
                "a100-80",
                8 * pp,
                layout(1, 8, pp, mb, gbs, zero=0, checkpoint="selective", chunks=v, sp=True, **SCORES_IN_HBM),
                # C2: MFU · 312e12 / (72·l·h²·(1 + s/6h + V/12hl))
                c2(mfu, l, h),
                f"MFU {mfu:.1%} (Table 5; C2)",
                notes,
                "Megatron-LM 2022 (SP + selective)",
            )
        )
    return out


def bloom() -> list[Run]:
    # 104.70 s per iteration of 2048 sequences x 2048 tokens on 384 GPUs:
    # 2048·2048 / (104.70·384) = 104.3 tokens/s/GPU (C1 from the logged 149.77 TFLOP/s gives the same).
    return [
        Run(
            "BLOOM-176B",
            BLOOM,
            gpt(70, 14336, 112, vocab=250_880),
            SEQ_GPT,
            "a100-80",
            384,
            layout(8, 4, 12, 2, 2048, zero=1, **SCORES_IN_HBM),
            per_iteration(2048, SEQ_GPT, 104.70, 384),
            "104.70 s/iter, 149.77 TFLOP/s/GPU (C3 = C1)",
            [
                "DeepSpeed BF16 optimizer = ZeRO-1 equivalent; full recomputation; DeepSpeed PP (1F1B, "
                "not interleaved)",
                "Jean Zay: Omni-Path between nodes (preset: DGX, 8 x HDR IB)",
                "vocab padded to 250,880; ALiBi, LayerNorm and biases not modelled",
            ],
            "Megatron-DeepSpeed (BLOOM)",
        )
    ]


def mosaic() -> list[Run]:
    """llm-foundry benchmark table: FSDP FULL_SHARD (= ZeRO-3), tokens/s per GPU as reported (C5)."""
    mpt = lambda l, h, heads: ModelShape(l, h, heads, heads, 4 * h, 50_368, tied=True, gated=False)  # noqa: E731
    note = "FSDP FULL_SHARD = ZeRO-3"
    return [
        Run(
            "MPT-70B H100",
            MOSAIC,
            mpt(80, 8192, 64),
            2048,
            "h100",
            64,
            layout(64, 1, 1, 8, 2048, zero=3),
            1039,
            "1039 tok/s/GPU, MFU 42.57% (C5)",
            [note, "activation checkpointing on (full)", "amp_bf16"],
            "MosaicML FSDP",
        ),
        Run(
            "MPT-70B A100-80",
            MOSAIC,
            mpt(80, 8192, 64),
            2048,
            "a100-80",
            64,
            layout(64, 1, 1, 8, 2048, zero=3),
            410,
            "410 tok/s/GPU, MFU 53.33% (C5)",
            [note, "activation checkpointing on (full)", "RoCE 1600 Gbps per node (preset: 8 x 22 GB/s IB)"],
            "MosaicML FSDP",
        ),
        Run(
            "MPT-13B A100-40",
            MOSAIC,
            mpt(40, 5120, 40),
            2048,
            "a100-40",
            64,
            layout(64, 1, 1, 16, 1024, zero=3),
            1976,
            "1976 tok/s/GPU, MFU 52.04% (C5)",
            [note, "activation checkpointing on (full)"],
            "MosaicML FSDP",
        ),
        Run(
            "MPT-7B H100",
            MOSAIC,
            mpt(32, 4096, 32),
            2048,
            "h100",
            8,
            layout(8, 1, 1, 6, 48, zero=3, checkpoint="none"),
            10643,
            "10643 tok/s/GPU, MFU 46.44% (C5)",
            [note, "no activation checkpointing"],
            "MosaicML FSDP",
        ),
    ]


OP_SAC_NOTE = (
    "selective op AC = torchtitan's op-level policy, checkpoint 'op_sac': every second matmul of a "
    "block recomputed (parallelize_llama.py at 3faaa1a0d: 'Saves output of all compute ops, except "
    "every second mm')"
)


def torchtitan() -> list[Run]:
    """FSDP2 only (= ZeRO-3) on 64 A100-80GB, local batch 1 x 8192 tokens; tokens/s per GPU as reported (C6)."""
    return [
        Run(
            "torchtitan Llama 3 8B",
            TITAN,
            ARCHITECTURES["llama3-8b"],
            8192,
            "a100-80",
            64,
            layout(64, 1, 1, 1, 64, zero=3, checkpoint="op_sac"),
            2973,
            "2973 tok/s/GPU, MFU 58.2% (C6)",
            ["FSDP2 = ZeRO-3", OP_SAC_NOTE, "seq 8192 inferred"],
            "torchtitan FSDP2",
        ),
        Run(
            "torchtitan Llama 3 70B",
            TITAN,
            ARCHITECTURES["llama3-70b"],
            8192,
            "a100-80",
            64,
            layout(64, 1, 1, 1, 64, zero=3),
            331,
            "331 tok/s/GPU, MFU 51.7% (C6)",
            ["FSDP2 = ZeRO-3", "full AC", "seq 8192 inferred"],
            "torchtitan FSDP2",
        ),
    ]


def llama3() -> list[Run]:
    """Table 4, stages 1 and 2 (8K sequences, no activation checkpointing)."""
    shape, out = ARCHITECTURES["llama3-405b"], []
    for stage, dp, per_dp, x, mfu in ((1, 64, 32, 430, 43), (2, 128, 16, 400, 41)):
        out.append(
            Run(
                f"Llama 3 405B stage {stage}",
                LLAMA3,
                shape,
                8192,
                "h100",
                8 * 16 * dp,
                layout(dp, 8, 16, 1, dp * per_dp, zero=1, checkpoint="none", chunks=2),
                # C4: X / (6N + 12·l·h·s), N = 405.9e9 (all parameters), l = 126, h = 16384, s = 8192
                c4(x, shape, 8192),
                f"{x} TFLOP/s/GPU, BF16 MFU {mfu}% (C4)",
                [
                    "FSDP with PP in the paper: modelled as ZeRO-1 (the planner's engine does not run ZeRO-3 "
                    "with pipelines)",
                    CHUNKS_NOTE.format(v=2),
                    "micro batch 1 assumed (not given)",
                    "sequence parallelism not stated: off",
                    "no activation checkpointing (paper)",
                    "vocab 128,256 (HF config; paper: 128,000)",
                ],
                "Llama 3 (Meta)",
            )
        )
    return out


SKIPPED = [
    ("MT-NLG 530B (Smith et al., arXiv:2201.11990)", "second-hand only (cli99/llm-analysis); micro batch unknown"),
    (
        "Korthikanti 530B on 2240 GPUs (MFU 54.2%)",
        "§6.3 gives it (Table 3's 530B layout with 8-way data parallelism, batch 2240, 39.15 s per iteration); "
        "not yet added, so that the 62 runs compared so far stay the same set",
    ),
    ("OPT-175B (arXiv:2205.01068)", "layout not fully known (FSDP + TP8 assumed), FLOP convention not stated"),
    (
        "Llama 3 405B long context (seq 131,072)",
        "context parallelism: compared apart from these runs (long_context.py), so this set stays the same",
    ),
    ("torchtitan Llama 3.1 405B on 512 H100 (3D, 4D tables)", "Float8 linears beside TP, PP and async TP"),
    ("Megatron-Bridge Llama 3 70B / 405B", "FP8"),
    (
        "Megatron-LM README GPT-3 175B H100 strong scaling (96 to 4608 GPUs)",
        "per-point layouts and throughputs only in a plot; the text gives the end points' MFU (47% and 42%) alone",
    ),
    ("Narayanan GPT-3 175B on 1024 GPUs (140 TFLOP/s)", "layout not given"),
    (
        "ZeRO (Rajbhandari et al., arXiv:1910.02054) runs on 400 V100s",
        "per-run throughputs only in Figures 2-4 and 8; the text gives averages over model sizes (15 PFLOP/s for "
        "8B-100B, over 40 TFLOP/s per GPU for up to 13B) and the batch sizes are in an appendix not read",
    ),
    ("Turing-NLG 17B with ZeRO-100B (41.4 TFLOP/s/GPU, the same paper, §10.6)", "GPUs, MP degree and batch not given"),
    (
        "ZeRO-Offload (arXiv:2101.06840): 40 TFLOP/s for 10B on one V100",
        "batch and sequence of that run not in a text read; the DeepSpeed tutorial's 10B log (an image) runs one GPU "
        "of a DGX-2, whose CPU Adam rate (the whole host's) no preset gives",
    ),
    (
        "ZeRO-3 Offload blog / ZeRO-Infinity (arXiv:2104.07857): 1T on 512 V100s, 49 TFLOP/s/GPU",
        "layouts in the paper's appendix, not read; ZeRO-Infinity's NVMe offload is not modelled",
    ),
    (
        "DeepSpeed on Azure: 530B peak 171.37 TFLOP/s/GPU, 175B at sequence 1024",
        "micro batch of the 530B peak not stated; the 175B sequence-1024 runs only in a figure",
    ),
    (
        "torchtitan and Trainy Float8 rows (H100, H200)",
        "FP8 (torchtitan's Llama 3.1 8B FSDP x CP table, Float8 too, is compared apart: long_context.py)",
    ),
]
