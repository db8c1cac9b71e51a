"""The tiny MoE model the expert-parallel tests train (test_moe_expert_parallel.py, test_moe_checkpoint.py),
its batches, and one process holding every expert training it as the reference."""

import torch
import torch.nn as nn
import torch.nn.functional as F

from zerotron.moe import MoE

VOCAB, HIDDEN, TOKENS, EXPERTS = 32, 16, 12, 4


def make_expert():
    return nn.Sequential(nn.Linear(HIDDEN, 2 * HIDDEN), nn.GELU(), nn.Linear(2 * HIDDEN, HIDDEN))


class TinyMoE(nn.Module):
    """Embedding, an MoE layer, a head; the experts numbered globally get their own weights (seeded by
    number), so a rank holding experts ep_rank * local ... is the one-process model's slice."""

    def __init__(self, ep_size=1, ep_rank=0, k=2):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = nn.Embedding(VOCAB, HIDDEN), nn.Linear(HIDDEN, VOCAB)
        dropless = dict(drop_tokens=False, top2_2nd_expert_sampling=False) if k == 2 else dict(use_rts=False)
        self.moe = MoE(HIDDEN, make_expert(), num_experts=EXPERTS, ep_size=ep_size, k=k, min_capacity=2, **dropless)
        local = EXPERTS // ep_size
        for j, expert in enumerate(self.moe.deepspeed_moe.experts.deepspeed_experts):
            torch.manual_seed(100 + ep_rank * local + j)
            for p in expert.parameters():
                nn.init.normal_(p, std=0.3)
        with torch.no_grad():  # every token's feature 0 is 3 and expert 3's logit -50 times it: never
            self.embed.weight[:, 0] = 3.0  # picked, so ZeRO-3 must finish steps where it gets no tokens
            self.moe.deepspeed_moe.gate.wg.weight[3] = 0.0
            self.moe.deepspeed_moe.gate.wg.weight[3, 0] = -50.0

    def forward(self, ids, targets):
        out, l_aux, _ = self.moe(self.embed(ids))
        return F.cross_entropy(self.head(out).flatten(0, 1), targets.flatten()) + 0.01 * l_aux


def batches(steps, world):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (world, TOKENS + 1), generator=g) for _ in range(steps)]


def optimizer(params, adam):
    return torch.optim.AdamW(params, lr=0.01) if adam else torch.optim.SGD(params, lr=0.1, momentum=0.9)


def reference(steps, world, k, adam, clip):
    model = TinyMoE(k=k)
    opt = optimizer(model.parameters(), adam)
    losses = []
    for b in batches(steps, world):
        loss = sum(model(b[r : r + 1, :-1], b[r : r + 1, 1:]) for r in range(world)) / world
        opt.zero_grad()
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.clone() for k, v in model.state_dict().items()}
