"""Ulysses sequence parallelism through DeepSpeed's API: `DistributedAttention` gives the attention of
the whole sequence (forward and backward), and a model written as a DeepSpeed-Ulysses script, each
rank feeding its slice of every sequence with `sequence_parallel_size` in the config, trains like one
process on the full sequences at ZeRO 0-3, alone and beside data parallelism. Each rank's loss is
the full sequence's mean (ALST's recipe: per-token losses gathered over the sequence ranks)."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from distributed import RankError, run_ranks

import zerotron
from tools.ulysses_script import HEADS, KV_HEADS, SEQ, Local, TinyLM, attention, batches, optimizer_config, reference


def _attention_parity(batch_dim_idx):
    from zerotron.long_context import DistributedAttention
    from zerotron.long_context import mpu as parallel_state_sp

    sp = dist.get_world_size()
    parallel_state_sp.initialize_sequence_parallel(sp)
    group, rank = parallel_state_sp.get_sequence_parallel_group(), parallel_state_sp.get_sequence_parallel_rank()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, SEQ, h, 8, generator=g, requires_grad=True) for h in (HEADS, KV_HEADS, KV_HEADS))
    full = attention(q, k, v)
    full.square().sum().backward()
    mine = slice(rank * SEQ // sp, (rank + 1) * SEQ // sp)
    layout = (lambda t: t) if batch_dim_idx == 0 else (lambda t: t.transpose(0, 1))
    local = [layout(t.detach()[:, mine]).requires_grad_() for t in (q, k, v)]
    attn = DistributedAttention(Local() if batch_dim_idx == 0 else _SeqFirst(), group)
    out = attn(*local, batch_dim_idx=batch_dim_idx)
    out.square().sum().backward()
    errors = [(layout(out) - full[:, mine]).abs().max().item()]
    errors += [(layout(t.grad) - full_t.grad[:, mine]).abs().max().item() for t, full_t in zip(local, (q, k, v))]
    sent = zerotron.comm.comm_for(group).stats()["all_to_all"]
    return errors, sent


class _SeqFirst(nn.Module):
    def forward(self, q, k, v):  # [s, b, h, d]
        return attention(*(t.transpose(0, 1) for t in (q, k, v))).transpose(0, 1)


@pytest.mark.parametrize("world,batch_dim_idx", [(2, 0), (2, 1)])
def test_distributed_attention_is_the_attention_of_the_whole_sequence(world, batch_dim_idx):
    for errors, sent in run_ranks(_attention_parity, world, batch_dim_idx):
        assert max(errors) < 1e-6, errors
        # forward: q (4 heads), k, v (2 each), the output (4): each rank sends (sp-1)/sp of its slice
        elements = 2 * (SEQ // world) * 8 * (HEADS + KV_HEADS + KV_HEADS + HEADS) * (world - 1) // world
        assert sent == 2 * elements * 4  # as much again in backward; fp32


def _ulysses(sp, stage, kind, steps, rows):
    from zerotron.long_context import mpu as parallel_state_sp

    parallel_state_sp.initialize_sequence_parallel(sp)
    group = parallel_state_sp.get_sequence_parallel_group()
    rank, dp = parallel_state_sp.get_sequence_parallel_rank(), dist.get_world_size() // sp
    config = {
        "train_batch_size": rows,
        "gradient_clipping": 0.0,
        "sequence_parallel_size": sp,
        "zero_optimization": {"stage": stage},
        "optimizer": optimizer_config(kind),
    }
    engine, *_ = zerotron.initialize(model=TinyLM(group), config=config, mpu=parallel_state_sp)
    mine, dp_rank = slice(rank * SEQ // sp, (rank + 1) * SEQ // sp), engine.coords.dp
    losses = []
    for ids, labels in batches(steps, rows):
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
    want_losses, want = reference(steps, rows, kind)
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


def _gpt_with_ulysses(sp, stage, steps, batch):
    from parity import ds_config, global_batches, make_model, micro_batches

    from zerotron.zero import consolidated_state_dict

    config = ds_config(batch // (dist.get_world_size() // sp), 1, sequence_parallel_size=sp)
    config["zero_optimization"] = {"stage": stage}
    engine, *_ = zerotron.initialize(model=make_model(), config=config)
    dp, n = engine.topology.dp, SEQ_GPT // sp
    mine = slice(engine.coords.sp * n, (engine.coords.sp + 1) * n)
    losses = []
    for batch_ in global_batches(steps, batch):
        ((x, y),) = micro_batches(batch_, engine.coords.dp, dp, 1)
        loss = engine(x[:, mine], y[:, mine])
        engine.backward(loss)
        engine.step()
        losses.append(engine._mean_over_dp(loss.detach()).item())
    return losses, consolidated_state_dict(engine.module), engine.comm_stats()["all_to_all"]


SEQ_GPT = 16  # parity.SEQ


@pytest.mark.parametrize("world,sp,stage", [(2, 2, 1), (4, 2, 2)])
def test_the_reference_gpt_with_sequence_parallel_size_trains_like_one_process(world, sp, stage):
    """What `zerotron train --sp N` runs: the GPT's adapter wraps every attention core in the
    all-to-alls, offsets each slice's rotary positions and makes the loss the whole sequence's."""
    from parity import assert_losses_close, global_batches, max_weight_diff, reference_training

    steps, batch = 3, 4
    want_losses, want = reference_training(global_batches(steps, batch))
    for losses, state, sent in run_ranks(_gpt_with_ulysses, world, sp, stage, steps, batch, timeout=120):
        assert_losses_close(losses, want_losses, 1e-6)
        assert max_weight_diff(state, want) < 1e-5
        assert sent > 0


def _plain_model_with_sequence_parallel_size():
    zerotron.initialize(model=nn.Linear(4, 4), config={"train_batch_size": 1, "sequence_parallel_size": 2})


def test_a_model_whose_attention_would_see_only_its_slice_is_refused():
    with pytest.raises(RankError, match="Linear's attention does not go through DistributedAttention"):
        run_ranks(_plain_model_with_sequence_parallel_size, 2)


def _saved_activation_bytes(model, x, y) -> int:
    """Bytes of the distinct non-parameter tensors autograd keeps for backward in one forward."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x, y)
    return sum(seen.values())


def _gpt(seq):
    from zerotron.models.gpt import GPT, config_for

    torch.manual_seed(0)
    return GPT(config_for("tiny", max_seq_len=seq))


def _kept_for_backward_with_ulysses(seq):
    config = {
        "train_batch_size": 2,
        "sequence_parallel_size": dist.get_world_size(),
        "optimizer": optimizer_config("sgd"),
    }
    engine, *_ = zerotron.initialize(model=_gpt(seq), config=config)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (2, seq + 1), generator=g)
    n = seq // engine.topology.sp
    mine = slice(engine.coords.sp * n, (engine.coords.sp + 1) * n)
    return _saved_activation_bytes(engine.module, tokens[:, :-1][:, mine], tokens[:, 1:][:, mine])


def test_each_sequence_rank_keeps_its_share_of_the_activations():
    """Activations kept for backward per rank at most 1.1/sp of one process's on the whole sequence."""
    seq, sp = 256, 2
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (2, seq + 1), generator=g)
    whole = _saved_activation_bytes(_gpt(seq), tokens[:, :-1], tokens[:, 1:])
    for kept in run_ranks(_kept_for_backward_with_ulysses, sp, seq):
        assert kept <= 1.1 * whole / sp, (kept, whole)
