"""DeepSpeed's MoE layer on zerotron (issue 31): what it computes (dropless top-2 is each token's two
experts weighted by its normalized probabilities). Trained by the engine: test_moe_expert_parallel.py.
Against DeepSpeed 0.19.8's layer on the same weights, input and random stream (tools/moe_layer_compare.py,
DeepSpeed's interpreter): outputs, l_aux, exp_counts and input gradients bit-identical in 14 cases, the
parameters' gradients within 5e-7 (summed in another order: no padded capacity rows)."""

import torch
import torch.nn as nn
import torch.nn.functional as F

from zerotron.moe import MoE

VOCAB, HIDDEN, TOKENS = 32, 16, 12


def _expert():
    return nn.Sequential(nn.Linear(HIDDEN, 2 * HIDDEN), nn.GELU(), nn.Linear(2 * HIDDEN, HIDDEN))


def test_dropless_top2_is_each_tokens_two_experts_weighted():
    torch.manual_seed(0)
    layer = MoE(HIDDEN, _expert(), num_experts=4, k=2, drop_tokens=False, top2_2nd_expert_sampling=False)
    x = torch.randn(3, 5, HIDDEN)
    out, l_aux, counts = layer(x)
    probs = F.softmax(x.reshape(-1, HIDDEN) @ layer.deepspeed_moe.gate.wg.weight.t(), dim=-1)
    top, idx = probs.topk(2, dim=-1)
    experts = layer.deepspeed_moe.experts.deepspeed_experts
    want = torch.stack(
        [
            sum(w / top[t].sum() * experts[e](x.reshape(-1, HIDDEN)[t]) for w, e in zip(top[t], idx[t]))
            for t in range(15)
        ]
    )
    torch.testing.assert_close(out.reshape(-1, HIDDEN), want, rtol=1e-5, atol=1e-6)
    assert counts.sum() == 30 and l_aux.requires_grad
    out.sum().backward()
    assert all(p.grad is not None for p in layer.parameters())
