"""Published runs that split each sequence over ranks (context parallelism), compared with the planner apart
from the 62 runs of comparison.py, so that set stays the same: torchtitan's Llama 3.1 8B table of FSDP x CP
runs from 32,768 to 262,144 tokens, and Llama 3 405B's long-context stage (CP 16 at 131,072 tokens). Every
figure is quoted from the named source; conventions and helpers: conventions.py.

    python tests/planner_published/long_context.py
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # run as a script: this package and zerotron importable
    TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path[:0] = [os.path.dirname(TESTS), TESTS]

from planner_published.comparison import evaluate, table  # noqa: E402
from planner_published.conventions import Run, c4, layout  # noqa: E402
from planner_published.more_runs import GRAND_TETON, GT_NOTE, TITAN_H100  # noqa: E402
from zerotron.planner.model import ARCHITECTURES  # noqa: E402

LLAMA3_CP = (
    "Llama 3 Herd of Models, arXiv:2407.21783, Table 4, read from a transcription "
    "(aarnphm.xyz/thoughts/Llama-3); GPUs, TP, CP, PP and TFLOP/s also on Balaji's SC'24 slide "
    "(glennklockwood.com/garden/llama-3.1)"
)
TITAN_CP_NOTES = [
    "FSDP2 over the FSDP x CP ranks (torchtitan's dp_shard_cp mesh, parallel_dims.py at 9dec370): ZeRO-3 "
    "over dp x cp, as zerotron's",
    "TPS/GPU = the whole sequences' tokens / (time x cp) (train.py at 9dec370): the planner's tokens/s / GPUs",
    "CP: PyTorch's context_parallel, load-balanced, key/value shards exchanged by all-gather (torchtitan's "
    "default context_parallel_rotate_method, config_manager.py at 9dec370): costed as zerotron's ring passes "
    "(the same bytes in forward)",
    "local batch 1, full activation checkpointing (every_block)",
    "torch.compile and Float8 linears: not modelled (Table 1 of the source: Float8 added 28% over compile "
    "alone at 8,192 tokens; the linears are 47%, 30%, 18% and 10% of the FLOPs at 32K, 64K, 128K, 256K)",
    GT_NOTE,
]


def torchtitan_cp() -> list[Run]:
    """Table 2 of the source: Llama 3.1 8B, 8 GPUs, FSDP + CP + torch.compile + Float8, local batch 1,
    full activation checkpointing: (FSDP, CP, sequence length, TPS/GPU)."""
    shape, out = ARCHITECTURES["llama3-8b"], []
    for dp, cp, seq, x in ((8, 1, 32768, 3890), (4, 2, 65536, 2540), (2, 4, 131072, 1071), (1, 8, 262144, 548)):
        out.append(
            Run(
                f"torchtitan H100 Llama 3.1 8B FSDP {dp} CP {cp}, seq {seq:,}",
                f"{TITAN_H100}, Table 2",
                shape,
                seq,
                "h100",
                8,
                layout(dp, 1, 1, 1, dp, zero=3, checkpoint="every_block", ring=cp),
                x,
                f"{x:,} TPS/GPU (C6)",
                list(TITAN_CP_NOTES),
                "torchtitan FSDP2 + CP (H100)",
                GRAND_TETON,
            )
        )
    return out


def llama3_long_context() -> Run:
    """Table 4's long-context row: 16,384 GPUs, TP 8, CP 16, PP 16, DP 8, 131,072 tokens, 16 sequences per
    data-parallel rank (16M tokens a batch), 380 TFLOP/s per GPU, BF16 MFU 38%."""
    shape = ARCHITECTURES["llama3-405b"]
    return Run(
        "Llama 3 405B long context (CP 16)",
        LLAMA3_CP,
        shape,
        131072,
        "h100",
        8 * 16 * 16 * 8,
        layout(8, 8, 16, 1, 8 * 16, zero=1, checkpoint="none", chunks=2, ring=16),
        # C4: X / (6N + 12·l·h·s), N = 405.9e9, l = 126, h = 16384, s = 131072
        c4(380, shape, 131072),
        "380 TFLOP/s/GPU, BF16 MFU 38% (C4)",
        [
            "as the paper's stage 1 and 2 rows (runs.py): FSDP with PP modelled as ZeRO-1, 2 virtual stages "
            "assumed, micro batch 1 assumed, no activation checkpointing, sequence parallelism off",
            "CP: all-gather based (the paper: K and V all-gathered, then attention for the local query chunk; "
            "rank groups ordered TP, CP, PP, DP, so a CP group spans 16 nodes): costed as zerotron's ring "
            "passes (the same bytes; with 8 key/value heads over TP 8 they are small beside the attention)",
            "C4 assumed as for the other Llama 3 rows (12·l·h·s for attention): at 131,072 tokens attention is "
            "57% of 6N + 12·l·h·s; had the paper counted causal attention as half (6·l·h·s), the achieved "
            "tokens/s would be 1.40x this",
        ],
        "Llama 3 (Meta)",
    )


def runs() -> list[Run]:
    return torchtitan_cp() + [llama3_long_context()]


def comparison() -> list[dict]:
    return [evaluate(r) for r in runs()]


def main() -> None:
    print(table(comparison()))


if __name__ == "__main__":
    main()
