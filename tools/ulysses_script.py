"""A DeepSpeed-Ulysses training script's pieces: a small decoder whose attention goes through
DeepSpeed's `DistributedAttention` (grouped key/value heads), ALST's loss (the full sequence's mean on
every sequence rank), seeded batches with masked tokens, and one process training it on the full
sequences. tests/test_ulysses.py runs it under zerotron; tools/ulysses_gradient_scale.py under zerotron or
DeepSpeed."""

import torch
import torch.nn as nn
import torch.nn.functional as F

SEQ, VOCAB, DIM, HEADS, KV_HEADS, LAYERS = 16, 64, 32, 4, 2, 2


def attention(q, k, v):
    """Causal attention on [b, s, h, d] with grouped key/value heads."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)


class Local(nn.Module):
    def forward(self, q, k, v, *args):
        return attention(q, k, v)


class TinyLM(nn.Module):
    """A DeepSpeed-Ulysses script's model: each rank runs its slice of the sequence; attention goes
    through DistributedAttention over the sequence group (None: one process, the whole sequence)."""

    def __init__(self, group=None, distributed_attention=None):
        super().__init__()
        if distributed_attention is None:
            from zerotron.long_context import DistributedAttention as distributed_attention

        torch.manual_seed(0)
        self.embed, self.pos = nn.Embedding(VOCAB, DIM), nn.Embedding(SEQ, DIM)
        self.qkv = nn.ModuleList(nn.Linear(DIM, DIM + 2 * DIM * KV_HEADS // HEADS) for _ in range(LAYERS))
        self.out = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(LAYERS))
        self.mlp = nn.ModuleList(
            nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM)) for _ in range(LAYERS)
        )
        self.norm, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB)
        self.attn = distributed_attention(Local(), group) if group is not None else Local()
        self.group = group

    def forward(self, ids, positions, labels):
        x = self.embed(ids) + self.pos(positions)
        b, s, d = x.shape[0], x.shape[1], DIM // HEADS
        for qkv, out, mlp in zip(self.qkv, self.out, self.mlp):
            q, k, v = qkv(x).split([DIM, DIM * KV_HEADS // HEADS, DIM * KV_HEADS // HEADS], dim=-1)
            q, k, v = q.view(b, s, HEADS, d), k.view(b, s, KV_HEADS, d), v.view(b, s, KV_HEADS, d)
            x = x + out(self.attn(q, k, v, 0).reshape(b, s, DIM))  # batch_dim_idx 0, as DeepSpeed requires
            x = x + mlp(x)
        losses = F.cross_entropy(self.head(self.norm(x)).flatten(0, 1), labels.flatten(), reduction="none")
        total, count = losses.sum(), (labels != -100).sum().float()
        if self.group is None:
            return total / count
        # ALST's recipe: the full sequence's mean on every rank, through a differentiable collective
        # (ALST's tutorial all-gathers; torch's differentiable all_gather breaks on gloo subgroups that
        # do not start at rank 0 -- its backward scatters from a group rank as if it were global --
        # so the sums are all-reduced, which differentiates the same way)
        total = torch.distributed.nn.functional.all_reduce(total, group=self.group)
        count = torch.distributed.nn.functional.all_reduce(count, group=self.group)
        return total / count


def batches(steps, rows):
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (rows, SEQ + 1), generator=g)
        labels = tokens[:, 1:].clone()
        labels[:, -5:] = -100  # the last sequence rank has fewer valid tokens: the mean must be the whole sequence's
        out.append((tokens[:, :-1], labels))
    return out


def optimizer_config(kind):
    if kind == "sgd":
        return {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}
    return {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-6, "weight_decay": 0.1}}


def reference(steps, rows, kind):
    model = TinyLM()
    cls = torch.optim.SGD if kind == "sgd" else torch.optim.AdamW
    opt = cls(model.parameters(), **optimizer_config(kind)["params"])
    losses = []
    for ids, labels in batches(steps, rows):
        loss = model(ids, torch.arange(SEQ).expand_as(ids), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}
