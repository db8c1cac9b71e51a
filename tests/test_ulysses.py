"""Ulysses sequence parallelism through DeepSpeed's API: `DistributedAttention` gives the attention of
the whole sequence (forward and backward), and a model written as a DeepSpeed-Ulysses script, each
rank feeding its slice of every sequence with `sequence_parallel_size` in the config, trains like one
process on the full sequences at ZeRO 0-3, alone and beside data parallelism. Each rank's loss is
the full sequence's mean (ALST's recipe: per-token losses gathered over the sequence ranks)."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from distributed import run_ranks

import zerotron

SEQ, VOCAB, DIM, HEADS, KV_HEADS, LAYERS = 16, 64, 32, 4, 2, 2


def _attention(q, k, v):
    """Causal attention on [b, s, h, d] with grouped key/value heads."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)


class _Local(nn.Module):
    def forward(self, q, k, v):
        return _attention(q, k, v)


def _attention_parity(batch_dim_idx):
    from zerotron.compat import parallel_state_sp
    from zerotron.long_context import DistributedAttention

    sp = dist.get_world_size()
    parallel_state_sp.initialize_sequence_parallel(sp)
    group, rank = parallel_state_sp.get_sequence_parallel_group(), parallel_state_sp.get_sequence_parallel_rank()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, SEQ, h, 8, generator=g, requires_grad=True) for h in (HEADS, KV_HEADS, KV_HEADS))
    full = _attention(q, k, v)
    full.square().sum().backward()
    mine = slice(rank * SEQ // sp, (rank + 1) * SEQ // sp)
    layout = (lambda t: t) if batch_dim_idx == 0 else (lambda t: t.transpose(0, 1))
    local = [layout(t.detach()[:, mine]).requires_grad_() for t in (q, k, v)]
    attn = DistributedAttention(_Local() if batch_dim_idx == 0 else _SeqFirst(), group)
    out = attn(*local, batch_dim_idx=batch_dim_idx)
    out.square().sum().backward()
    errors = [(layout(out) - full[:, mine]).abs().max().item()]
    errors += [(layout(t.grad) - full_t.grad[:, mine]).abs().max().item() for t, full_t in zip(local, (q, k, v))]
    sent = zerotron.comm.comm_for(group).stats()["all_to_all"]
    return errors, sent


class _SeqFirst(nn.Module):
    def forward(self, q, k, v):  # [s, b, h, d]
        return _attention(*(t.transpose(0, 1) for t in (q, k, v))).transpose(0, 1)


@pytest.mark.parametrize("world,batch_dim_idx", [(2, 0), (2, 1)])
def test_distributed_attention_is_the_attention_of_the_whole_sequence(world, batch_dim_idx):
    for errors, sent in run_ranks(_attention_parity, world, batch_dim_idx):
        assert max(errors) < 1e-6, errors
        # forward: q (4 heads), k, v (2 each), the output (4): each rank sends (sp-1)/sp of its slice
        elements = 2 * (SEQ // world) * 8 * (HEADS + KV_HEADS + KV_HEADS + HEADS) * (world - 1) // world
        assert sent == 2 * elements * 4  # as much again in backward; fp32


class TinyLM(nn.Module):
    """A DeepSpeed-Ulysses script's model: each rank runs its slice of the sequence; attention goes
    through DistributedAttention over the sequence group (None: one process, the whole sequence)."""

    def __init__(self, group=None):
        super().__init__()
        from zerotron.long_context import DistributedAttention

        torch.manual_seed(0)
        self.embed, self.pos = nn.Embedding(VOCAB, DIM), nn.Embedding(SEQ, DIM)
        self.qkv = nn.ModuleList(nn.Linear(DIM, DIM + 2 * DIM * KV_HEADS // HEADS) for _ in range(LAYERS))
        self.out = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(LAYERS))
        self.mlp = nn.ModuleList(
            nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM)) for _ in range(LAYERS)
        )
        self.norm, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB)
        self.attn = DistributedAttention(_Local(), group) if group is not None else _Local()
        self.group = group

    def forward(self, ids, positions, labels):
        x = self.embed(ids) + self.pos(positions)
        b, s, d = x.shape[0], x.shape[1], DIM // HEADS
        for qkv, out, mlp in zip(self.qkv, self.out, self.mlp):
            q, k, v = qkv(x).split([DIM, DIM * KV_HEADS // HEADS, DIM * KV_HEADS // HEADS], dim=-1)
            q, k, v = q.view(b, s, HEADS, d), k.view(b, s, KV_HEADS, d), v.view(b, s, KV_HEADS, d)
            x = x + out(self.attn(q, k, v).reshape(b, s, DIM))
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


def _batches(steps, rows):
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (rows, SEQ + 1), generator=g)
        labels = tokens[:, 1:].clone()
        labels[:, -5:] = -100  # the last sequence rank has fewer valid tokens: the mean must be the whole sequence's
        out.append((tokens[:, :-1], labels))
    return out


def _optimizer(kind):
    if kind == "sgd":
        return {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}}
    return {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-6, "weight_decay": 0.1}}


def _reference(steps, rows, kind):
    model = TinyLM()
    cls = torch.optim.SGD if kind == "sgd" else torch.optim.AdamW
    opt = cls(model.parameters(), **_optimizer(kind)["params"])
    losses = []
    for ids, labels in _batches(steps, rows):
        loss = model(ids, torch.arange(SEQ).expand_as(ids), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _ulysses(sp, stage, kind, steps, rows):
    from zerotron.compat import parallel_state_sp

    parallel_state_sp.initialize_sequence_parallel(sp)
    group = parallel_state_sp.get_sequence_parallel_group()
    rank, dp = parallel_state_sp.get_sequence_parallel_rank(), dist.get_world_size() // sp
    config = {
        "train_batch_size": rows,
        "gradient_clipping": 0.0,
        "sequence_parallel_size": sp,
        "zero_optimization": {"stage": stage},
        "optimizer": _optimizer(kind),
    }
    engine, *_ = zerotron.initialize(model=TinyLM(group), config=config, mpu=parallel_state_sp)
    mine, dp_rank = slice(rank * SEQ // sp, (rank + 1) * SEQ // sp), engine.coords.dp
    losses = []
    for ids, labels in _batches(steps, rows):
        ids, labels = (t[dp_rank * rows // dp : (dp_rank + 1) * rows // dp, mine] for t in (ids, labels))
        loss = engine(ids, torch.arange(SEQ)[mine].expand_as(ids), labels)
        engine.backward(loss)
        engine.step()
        losses.append(engine._mean_over_dp(loss.detach()).item())
    from zerotron.zero import consolidated_state_dict

    return losses, consolidated_state_dict(engine.module), engine.comm_stats()["all_to_all"]


@pytest.mark.parametrize(
    "world,sp,stage,kind",
    [(2, 2, 0, "sgd"), (2, 2, 1, "adamw"), (2, 2, 2, "sgd"), (2, 2, 3, "adamw"), (4, 2, 3, "sgd")],
)
def test_ulysses_trains_like_one_process_on_the_whole_sequences(world, sp, stage, kind):
    steps, rows = 4, 4
    want_losses, want = _reference(steps, rows, kind)
    for losses, state, sent in run_ranks(_ulysses, world, sp, stage, kind, steps, rows, timeout=120):
        assert max(abs(a - b) / abs(b) for a, b in zip(losses, want_losses)) < 1e-6, (losses, want_losses)
        assert max((state[k] - v).abs().max().item() for k, v in want.items()) < 1e-5
        assert sent > 0


def test_sequence_parallel_size_is_checked_before_training():
    from zerotron.config import Config
    from zerotron.errors import ConfigError

    base = {"train_micro_batch_size_per_gpu": 1}
    assert Config.load({**base, "sequence_parallel_size": 2}, world_size=4).dp_size == 2
    with pytest.raises(ConfigError, match="sequence_parallel_size.*divide the number of processes"):
        Config.load({**base, "sequence_parallel_size": 3}, world_size=4)
    with pytest.raises(ConfigError, match="with tensor parallelism"):
        Config.load({**base, "sequence_parallel_size": 2, "tensor_parallel": {"autotp_size": 2}}, world_size=4)
    with pytest.raises(ConfigError, match="mpu=.*2 sequence-parallel ranks"):
        Config.load({**base, "sequence_parallel_size": 4}, world_size=4, sequence_parallel_size=2)
