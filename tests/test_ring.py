"""Ring attention / context parallelism (issue 30): the attention of the whole sequence from key/value
blocks passed around the ring (forward and every input gradient, causal in load-balanced halves and
not causal, more ranks than key/value heads), its point-to-point bytes the shape-derived count,
Ulysses x ring in two dimensions, and the reference GPT trained with `zerotron.context_parallel_size`
(alone, x Ulysses, x data parallelism) like one process."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from distributed import RankError, run_ranks

import zerotron
from zerotron.long_context.layout import SequenceSplit
from zerotron.long_context.ring import ring_shard, ring_unshard

SEQ, HEADS, DIM = 32, 4, 8


def _qkv(kv_heads, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    q, go = (torch.randn(2, HEADS, SEQ, DIM, generator=g) for _ in range(2))
    k, v = (torch.randn(2, kv_heads, SEQ, DIM, generator=g) for _ in range(2))
    return [t.to(dtype) for t in (q, k, v, go)]


def _whole(q, k, v, go, causal):
    """One process: attention over the whole sequence and its input gradients."""
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    groups = HEADS // k.shape[1]
    kk, vv = (t.repeat_interleave(groups, dim=1) for t in leaves[1:])
    out = F.scaled_dot_product_attention(leaves[0], kk, vv, is_causal=causal)
    out.backward(go)
    return [out] + [t.grad for t in leaves]


def _distributed(core, take, q, k, v, go):
    leaves = [take(t).clone().requires_grad_() for t in (q, k, v)]
    out = core(*leaves)
    out.backward(take(go))
    return [out] + [t.grad for t in leaves]


def _ring_parity(kv_heads, causal, dtype):
    from zerotron.comm import comm_for
    from zerotron.long_context.ring import ring_attention

    cp, rank = dist.get_world_size(), dist.get_rank()
    q, k, v, go = _qkv(kv_heads, dtype)
    take = (lambda t: ring_shard(t, 2, rank, cp)) if causal else (lambda t: t.chunk(cp, dim=2)[rank])
    got = _distributed(lambda *a: ring_attention(*a, None, causal=causal), take, q, k, v, go)
    want = [take(t) for t in _whole(q, k, v, go, causal)]
    return [(a.float() - b.float()).abs().max().item() for a, b in zip(got, want)], comm_for(None, "cp").stats()["p2p"]


@pytest.mark.parametrize(
    "world,kv_heads,causal",
    [(2, 2, True), (4, 1, True), (4, 2, False), (2, 4, False)],  # (4, 1): more ring ranks than key/value heads
)
def test_ring_attention_is_the_attention_of_the_whole_sequence(world, kv_heads, causal):
    for errors, sent in run_ranks(_ring_parity, world, kv_heads, causal, torch.float32):
        assert max(errors) < 2e-6, errors  # output, dq, dk, dv
        block = 2 * kv_heads * (SEQ // world) * DIM * 4  # one rank's k (or v), fp32
        # forward: k, v passed on cp-1 times; backward: k, v cp-1 times and dk, dv cp times
        assert sent == 2 * block * ((world - 1) + (world - 1) + world)


def test_ring_attention_in_bf16_stays_within_bf16():
    for errors, _ in run_ranks(_ring_parity, 2, 2, True, torch.bfloat16):
        assert max(errors) <= 2 * 2**-7 * 4, errors  # a few bf16 ulps of values of order 1-4


def _two_dimensional():
    from zerotron.long_context.model import RingCore, UlyssesCore
    from zerotron.topology import Topology

    topology = Topology(4, sp=2, cp=2).build_groups()
    split = SequenceSplit.of(topology, dist.get_rank())
    core = UlyssesCore(RingCore(topology.group("cp")), topology.group("sp"))
    q, k, v, go = _qkv(2)
    got = _distributed(core, lambda t: split.take(t, dim=2), q, k, v, go)
    want = [split.take(t, dim=2) for t in _whole(q, k, v, go, True)]
    return [(a - b).abs().max().item() for a, b in zip(got, want)]


def test_ulysses_around_ring_attention_in_two_dimensions():
    """sp 2 x cp 2: Ulysses' all-to-all gathers each ring rank's load-balanced part."""
    for errors in run_ranks(_two_dimensional, 4):
        assert max(errors) < 2e-6, errors


def test_the_load_balanced_layout():
    x = torch.arange(16)
    parts = [ring_shard(x, 0, r, 2) for r in range(2)]
    assert parts[0].tolist() == [0, 1, 2, 3, 12, 13, 14, 15] and torch.equal(ring_unshard(parts, 0), x)
    split = SequenceSplit(sp=2, sp_index=1, cp=2, cp_index=0)
    assert split.take(x, 0).tolist() == [12, 13, 14, 15] and split.positions(4)[0].tolist() == [12, 13, 14, 15]
    with pytest.raises(ValueError, match="multiple of 8"):
        split.take(torch.arange(12), 0)


def _gpt(sp, cp, stage, steps, batch):
    from parity import SEQ as seq
    from parity import ds_config, global_batches, make_model, micro_batches

    from zerotron.zero import consolidated_state_dict

    config = ds_config(batch // (dist.get_world_size() // (sp * cp)), 1, sequence_parallel_size=sp)
    config["zero_optimization"] = {"stage": stage}
    config["zerotron"] = {"context_parallel_size": cp}
    engine, *_ = zerotron.initialize(model=make_model(), config=config)
    split = SequenceSplit.of(engine.topology, dist.get_rank())
    assert seq % split.multiple() == 0
    losses = []
    for batch_ in global_batches(steps, batch):
        ((x, y),) = micro_batches(batch_, engine.coords.dp, engine.topology.dp, 1)
        loss = engine(split.take(x), split.take(y))
        engine.backward(loss)
        engine.step()
        losses.append(engine._mean_over_dp(loss.detach()).item())
    return losses, consolidated_state_dict(engine.module), engine.comm_stats()


@pytest.mark.parametrize("world,sp,cp,stage", [(2, 1, 2, 1), (4, 1, 2, 2), (4, 2, 2, 3)])
def test_the_reference_gpt_with_ring_attention_trains_like_one_process(world, sp, cp, stage):
    """What `zerotron train --cp N [--sp M]` runs: ring attention in every layer (inside Ulysses'
    all-to-alls in two dimensions), each token's rotary position its place in the whole sequence."""
    from parity import assert_losses_close, global_batches, max_weight_diff, reference_training

    steps, batch = 3, 4
    want_losses, want = reference_training(global_batches(steps, batch))
    for losses, state, stats in run_ranks(_gpt, world, sp, cp, stage, steps, batch, timeout=120):
        assert_losses_close(losses, want_losses, 1e-6)
        assert max_weight_diff(state, want) < 1e-5
        assert stats["p2p"] > 0 and (stats["all_to_all"] > 0) == (sp > 1)


def _plain_model_with_ring():
    zerotron.initialize(
        model=torch.nn.Linear(4, 4), config={"train_batch_size": 1, "zerotron": {"context_parallel_size": 2}}
    )


def test_ring_attention_where_it_is_not_built_is_refused_by_name():
    from zerotron.config import Config
    from zerotron.errors import ConfigError

    with pytest.raises(RankError, match="ring attention is applied by a model's adapter and Linear has none"):
        run_ranks(_plain_model_with_ring, 2)
    base = {"train_micro_batch_size_per_gpu": 1}
    assert Config.load({**base, "zerotron": {"context_parallel_size": 2}}, world_size=4).dp_size == 2
    with pytest.raises(ConfigError, match=r"context \(3\) parallel size must divide"):
        Config.load({**base, "zerotron": {"context_parallel_size": 3}}, world_size=4)


def _hf_ring(sp, cp, stage, steps):
    """A Transformers Llama (4 query, 2 key/value heads) with sequence_parallel_size / context_parallel_size
    in its config: the engine's adapter wraps its attention; each data rank's samples split by shard_batch."""
    from tools import alst_script as script
    from zerotron.long_context import shard_batch

    world = dist.get_world_size()
    config = {
        "train_batch_size": world // (sp * cp),
        "gradient_clipping": 0.0,
        "sequence_parallel_size": sp,
        "zerotron": {"context_parallel_size": cp},
        "zero_optimization": {"stage": stage},
        "optimizer": script.optimizer_config("sgd"),
    }
    engine, *_ = zerotron.initialize(model=script.build_model(), config=config)
    c, dp, seq = engine.coords, engine.topology.dp, engine.topology.group("seq")
    data, losses = script.samples(steps * dp), []
    for step in range(steps):
        batch = shard_batch(data[step * dp + c.dp], c.sp, sp, c.cp, cp)
        logits = engine(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        loss = script.sequence_loss(logits, batch["shift_labels"], seq)
        engine.backward(loss)
        engine.step()
        losses.append(engine._mean_over_dp(loss.detach()).item())
    return losses


@pytest.mark.parametrize("world,sp,cp,stage", [(2, 1, 2, 2), (4, 1, 4, 1), (4, 2, 2, 3)])
def test_a_transformers_llama_with_ring_attention_trains_like_one_process(world, sp, cp, stage):
    """cp 4 > its 2 key/value heads (what Ulysses cannot split); odd lengths padded to 2 x cp x sp;
    SGD with momentum, so a wrong gradient scale shows."""
    from tools import alst_script as script

    steps, dp = 4, world // (sp * cp)
    model, data = script.build_model(), script.samples(steps * dp)
    optimizer = torch.optim.SGD(model.parameters(), **script.optimizer_config("sgd")["params"])
    want = []
    for step in range(steps):
        loss = sum(model(**data[step * dp + d]).loss for d in range(dp)) / dp
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        want.append(loss.item())
    for losses in run_ranks(_hf_ring, world, sp, cp, stage, steps, timeout=120):
        assert max(abs(a - b) / b for a, b in zip(losses, want)) < 1e-6, (losses, want)
