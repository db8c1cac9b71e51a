"""DeepSpeed's MoE layer on zerotron (issue 31; every expert on every rank for now): what it computes
(dropless top-2 is each token's two experts weighted by its normalized probabilities), and a model
with it trained under data parallelism at ZeRO 0-3 like one process on the same micro-batches, an
expert that receives no tokens included (ZeRO-3 must not wait for it). Against DeepSpeed 0.19.8's
layer on the same weights, input and random stream (tools/moe_layer_compare.py, DeepSpeed's
interpreter): outputs, l_aux, exp_counts and every gradient bit-identical in 14 cases."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from distributed import run_ranks

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


class _TinyMoE(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = nn.Embedding(VOCAB, HIDDEN), nn.Linear(HIDDEN, VOCAB)
        self.moe = MoE(HIDDEN, _expert(), num_experts=4, k=2, drop_tokens=False, top2_2nd_expert_sampling=False)
        with torch.no_grad():  # a router that never picks expert 3: ZeRO-3 must still finish each step
            self.moe.deepspeed_moe.gate.wg.weight[3] = -50.0

    def forward(self, ids, targets):
        out, l_aux, _ = self.moe(self.embed(ids))
        return F.cross_entropy(self.head(out).flatten(0, 1), targets.flatten()) + 0.01 * l_aux


def _batches(steps, world):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (world, TOKENS + 1), generator=g) for _ in range(steps)]


def _reference(steps, world):
    model = _TinyMoE()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for b in _batches(steps, world):
        loss = sum(model(b[r : r + 1, :-1], b[r : r + 1, 1:]) for r in range(world)) / world
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.clone() for k, v in model.state_dict().items()}


def _train(stage, steps):
    import torch.distributed as dist

    import zerotron
    from zerotron.zero import consolidated_state_dict

    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
        "zero_allow_untested_optimizer": True,
    }
    engine, *_ = zerotron.initialize(model=_TinyMoE(), config=config)
    rank, world, losses = dist.get_rank(), dist.get_world_size(), []
    for b in _batches(steps, world):
        loss = engine(b[rank : rank + 1, :-1], b[rank : rank + 1, 1:])
        engine.backward(loss)
        engine.step()
        losses.append(engine._mean_over_dp(loss.detach()).item())
    return losses, consolidated_state_dict(engine.module)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_model_with_the_moe_layer_trains_like_one_process(stage):
    want_losses, want = _reference(4, 2)
    for losses, state in run_ranks(_train, 2, stage, 4, timeout=120):
        assert max(abs(a - b) / b for a, b in zip(losses, want_losses)) < 1e-6, (losses, want_losses)
        assert max((state[k] - want[k]).abs().max().item() for k in want) < 1e-5
        assert torch.equal(state["moe.deepspeed_moe.experts.deepspeed_experts.3.0.weight"],
                           want["moe.deepspeed_moe.experts.deepspeed_experts.3.0.weight"])  # fmt: skip
