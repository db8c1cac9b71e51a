"""Activation memory: the bytes one micro-batch's forward keeps for backward, per rank.

Counted as an inventory of what autograd saves, op by op, in the reference GPT as zerotron runs it
(tests/test_planner_memory.py checks each case against the tensors a real forward saves, on one process
and under tensor / sequence parallelism). Per block and token, with hidden d, ffn f, h heads, a
bytes per activation (4 in fp32, 2 in bf16/fp16) and tensor-parallel size t:

    each RMSNorm (2)        its input and normalised input in fp32, and 1/rms   8d + 4
    linear inputs           the two norms' outputs (gathered whole under          2·a·d
                            sequence parallelism)
    attention               q, k, v (k, v repeated to h heads), the output in     5·a·d / t
                            head and token layouts; log-sum-exp in fp32           + 4h / t
    MLP                     gate, silu(gate), up, their product                   4·a·f / t

A mixture of experts' MLP (E experts, k per token, expert hidden f_e; models/moe.py, moe/exchange.py)
keeps, per token: the router's probabilities in fp32, the top-k indices (int64), the chosen probabilities
and their sum (fp32), 4E + 12k + 4 bytes; and per row its experts run (k per token on one rank):
the rows, gate/up, silu, their product, the weighted output and the combine's copy, one weight and three
int64 indices, 3·a·d + 4·a·f_e + a + 24 (two-matrix experts: 2·a·f_e). Under expert parallelism a
rank's experts run the rows the others send it, imbalance x k per token on the busiest rank, grouped as
they arrive (moe/exchange.py: no weighting or combine on that side, the regrouping's index instead),
3·a·d + 4·a·f_e + 16 per row; each of its own k routes keeps its index, weight (fp32) and output back,
a·d + 12. Tensor parallelism keeps the experts whole. A shared MLP keeps what a dense
MLP of its width does.

Sequence parallelism splits the norms by t. Ring attention (context parallelism) keeps its own
inventory of the attention core (long_context/ring.py): q, k and v as they arrive (k, v not repeated:
GQA groups are expanded block by block), the merged output in fp32, the output in token layout, and
the log-sum-exp: 2·a·d + 2·a·kv + 4d + 4h per token (kv = the key/value width). Under Ulysses and
ring attention each rank keeps the whole inventory for its s/(u·c) tokens of each sequence (cost.py
passes that share as `seq`): Ulysses' attention holds heads/u heads over s/c tokens, as many
elements as all heads over s/(u·c). Once per micro-batch: token ids and targets, the
rotary tables (fp32), the final norm, the head's input, the logits in fp32 (split by t under a
vocabulary-parallel loss, which also keeps a mask and the targets).

Checkpointing: a checkpointed block keeps only its input (a·d per token, split by t with
`partition_activations` or sequence parallelism); `selective` keeps the block input and every
matmul output (q, k, v before rotary and repetition, the two row projections' partial sums, gate
and up) and recomputes the rest.

`op_sac` is not zerotron's: torchtitan's selective op checkpointing ("Saves output of all compute
ops, except every second mm", parallelize_llama.py) keeps the block input, the outputs of the
first, third, ... matmul (q, v, gate and down in a Llama block), the attention's output and its
log-sum-exp. This is that policy's inventory, not checked against a run as zerotron's policies are.
"""

from __future__ import annotations

from ..config import CHECKPOINT_POLICIES
from .memory import ModelShape

POLICIES = CHECKPOINT_POLICIES + ("op_sac",)  # zerotron's, and torchtitan's op-level policy (cost.py)


def bytes_per_activation(dtype: str) -> int:
    return 4 if dtype == "fp32" else 2


def block_bytes_per_token(
    shape: ModelShape,
    dtype: str = "fp32",
    tp: int = 1,
    sp: bool = False,
    ring: bool = False,
    ep: int = 1,
    imbalance: float = 1.0,
) -> dict[str, float]:
    """What one un-checkpointed block keeps per token, by part (`ring`: attention is ring attention;
    `ep`, `imbalance`: a mixture's experts over expert-parallel ranks)."""
    a, d, f, h = bytes_per_activation(dtype), shape.hidden, shape.ffn, shape.heads
    kv = d // h * shape.kv_heads
    sp = sp and tp > 1
    return {
        "norms": 2 * (8 * d + 4) / (tp if sp else 1),
        "linear inputs": 2 * a * d,
        "attention": ((2 * a * d + 2 * a * kv + 4 * d if ring else 5 * a * d) + 4 * h) / tp,
        "mlp": moe_bytes_per_token(shape, dtype, tp, ep, imbalance) if shape.experts else _mlp(shape, f, a) / tp,
    }


def _mlp(shape: ModelShape, width: int, a: int) -> float:
    return (4 if shape.gated else 2) * a * width  # two-matrix MLPs: input and activation


def moe_bytes_per_token(shape: ModelShape, dtype: str = "fp32", tp: int = 1, ep: int = 1, imbalance: float = 1.0):
    """What a mixture of experts' MLP keeps per token of this rank (the module docstring's inventory);
    `imbalance`: the busiest rank's rows over the mean, under expert parallelism."""
    a, d, k = bytes_per_activation(dtype), shape.hidden, shape.top_k
    router = 4 * shape.experts + 12 * k + 4
    row = 3 * a * d + _mlp(shape, shape.expert_ffn, a) + a + 24
    routes = 0.0
    if ep > 1:  # the rows arriving from the other ranks, run grouped; each own route's way back
        row = 3 * a * d + _mlp(shape, shape.expert_ffn, a) + 16
        routes = k * (a * d + 12)
    rows = k * (imbalance if ep > 1 else 1.0)
    return router + rows * row + routes + _mlp(shape, shape.shared_ffn, a) / tp


def selective_bytes_per_token(shape: ModelShape, dtype: str = "fp32", tp: int = 1) -> float:
    """What a block under selective checkpointing keeps per token besides its input: the matmul outputs
    (column outputs split, row outputs whole before the all-reduce). A mixture's experts multiply by
    grouped GEMMs, which the policy recomputes: of its MLP only the router's logits (and a shared MLP's
    outputs) are kept."""
    a, d, f = bytes_per_activation(dtype), shape.hidden, shape.ffn
    kv = d // shape.heads * shape.kv_heads
    columns = 2 if shape.gated else 1
    if shape.experts:
        shared = (columns * shape.shared_ffn / tp + d) if shape.shared_ffn else 0
        return a * ((d + 2 * kv) / tp + d + shape.experts + shared)
    return a * ((d + 2 * kv + columns * f) / tp + 2 * d)


def op_sac_bytes_per_token(shape: ModelShape, dtype: str = "fp32", tp: int = 1) -> float:
    """What a block under torchtitan's op-level policy keeps per token besides its input: every
    other matmul output from the first (column outputs split by t, row outputs whole), the
    attention's output and its log-sum-exp (fp32). A mixture's MLP counted as a dense one of the width a
    token runs (not checked against a run)."""
    a, d, f = bytes_per_activation(dtype), shape.hidden, shape.mlp_width
    kv = d // shape.heads * shape.kv_heads
    outputs = [d / tp, kv / tp, kv / tp, d] + ([f / tp, f / tp, d] if shape.gated else [f / tp, d])
    return a * (sum(outputs[0::2]) + d / tp) + 4 * shape.heads / tp


def activation_bytes(
    shape: ModelShape,
    micro_batch: int,
    seq: int,
    policy: str = "none",
    every: int = 2,
    *,
    dtype: str = "fp32",
    tp: int = 1,
    sp: bool = False,
    partition_activations: bool = False,
    layers: int | None = None,
    first_stage: bool = True,
    last_stage: bool = True,
    ring: bool = False,
    ep: int = 1,
    imbalance: float = 1.0,
) -> int:
    """Bytes one micro-batch keeps for backward on one rank. `layers`: the blocks this rank runs
    (all of them by default); `first_stage`/`last_stage`: whether it runs the embedding / head;
    `ring`: attention is ring attention; `seq`: the tokens of each sequence this rank holds; `ep`,
    `imbalance`: a mixture's experts over expert-parallel ranks, the busiest one's load over the mean."""
    if policy not in POLICIES:
        raise ValueError(f"activation memory is modelled for policies {', '.join(POLICIES)}, not {policy!r}")
    tokens = micro_batch * seq
    a, d = bytes_per_activation(dtype), shape.hidden
    layers = shape.layers if layers is None else layers
    sp = sp and tp > 1
    full = sum(block_bytes_per_token(shape, dtype, tp, sp, ring, ep, imbalance).values())
    kept_input = a * d / (tp if (sp or partition_activations) else 1)
    per_block = {
        "none": [full] * layers,
        "every_block": [kept_input] * layers,
        "every_k": [kept_input if i % every == 0 else full for i in range(layers)],
        "selective": [kept_input + selective_bytes_per_token(shape, dtype, tp)] * layers,
        "op_sac": [kept_input + op_sac_bytes_per_token(shape, dtype, tp)] * layers,
    }[policy]
    total = tokens * sum(per_block)
    if layers:
        total += (
            4 * seq * (d // shape.heads)
        )  # rotary cos and sin, shared by the blocks (and kept as checkpoint inputs)
    if first_stage and tp > 1:
        total += tokens  # the vocabulary-parallel embedding's mask
    if last_stage:
        total += 8 * tokens  # targets
        total += tokens * ((8 * d + 4) / (tp if sp else 1) + a * d + 4 * shape.vocab / tp)  # final norm, head, logits
        total += tokens * (8 + 2) if tp > 1 else 0  # the vocabulary-parallel loss: targets again, two masks
    if first_stage:
        total += 8 * tokens  # token ids
    return int(total)
