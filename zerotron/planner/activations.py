"""Activation memory: the bytes a forward keeps for backward, for the reference GPT in fp32.

Counted from what autograd saves, op by op (tests/test_planner.py checks the count against the
tensors a real forward saves). Per block, with B sequences of s tokens, hidden d, ffn f, h heads:
the block input and the two norms' inputs/outputs, q, k, v (k and v repeated to h heads for
grouped-query attention) and the attention output, the MLP's three f-wide tensors and its
product — 11·d + 4·f values per token — plus the norms' per-token statistics (2) and attention's
log-sum-exp (h). Once per model: the rotary tables, the token ids, the final norm, the logits
and the loss's log-softmax.

With checkpointing a checkpointed block keeps only its input (d per token). Not modelled yet:
selective checkpointing, tensor / sequence parallelism, bf16 (issue 8).
"""
from __future__ import annotations

from .memory import ModelShape


def activation_bytes(shape: ModelShape, micro_batch: int, seq: int, policy: str = "none", every: int = 2) -> int:
    if policy not in ("none", "every_block", "every_k"):
        raise ValueError(f"activation memory is modelled for policies none, every_block, every_k, not {policy!r}")
    tokens = micro_batch * seq
    d, f, h = shape.hidden, shape.ffn, shape.heads
    full_block = 4 * tokens * (11 * d + 4 * f + 2 + h)
    kept_block = 4 * tokens * d
    checkpointed = {"none": 0, "every_block": shape.layers, "every_k": len(range(0, shape.layers, every))}[policy]
    blocks = (shape.layers - checkpointed) * full_block + checkpointed * kept_block
    rotary = 4 * seq * (d // h)  # cos and sin, fp32, once per forward (checkpointed blocks keep them as inputs)
    outside = 8 * tokens + 4 * (3 * tokens * d + tokens + tokens * shape.vocab) + 4  # ids, final norm, logits, loss
    return blocks + rotary + outside
