"""Activation checkpointing: same training with less activation memory, under every strategy."""

import pytest
import torch
import torch.nn as nn
from distributed import run_ranks
from parity import (
    assert_losses_close,
    ds_config,
    global_batches,
    make_model,
    max_weight_diff,
    micro_batches,
    reference_training,
)
from torch.profiler import ProfilerActivity, profile

import zerotron
from zerotron import checkpointing
from zerotron.errors import ConfigError
from zerotron.models.gpt import GPT, config_for
from zerotron.parallelize import to_pipeline

STEPS = 3


def _forward_bytes(model, x, y) -> int:
    """Memory the forward leaves allocated (what backward will need), from the profiler's
    allocation events: catches what checkpointing keeps internally too."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss = model(x, y)
    loss.backward()
    return sum(e.self_cpu_memory_usage for e in prof.events())


@pytest.mark.parametrize("policy,saving", [("every_block", 0.60), ("every_k", 0.30), ("selective", 0.30)])
def test_checkpointing_cuts_the_memory_kept_for_backward(policy, saving):
    x, y = torch.randint(0, 256, (8, 128)), torch.randint(0, 256, (8, 128))
    kept = {}
    for p in ("none", policy):
        torch.manual_seed(0)
        model = GPT(config_for("small", max_seq_len=128))
        checkpointing.apply_policy(model, p, every=2)
        kept[p] = _forward_bytes(model, x, y)
    assert kept[policy] <= (1 - saving) * kept["none"], kept


def test_dropout_masks_are_replayed_in_the_recomputation():
    x, y = torch.randint(0, 256, (4, 32)), torch.randint(0, 256, (4, 32))
    grads = {}
    for policy in ("none", "every_block", "selective"):
        torch.manual_seed(0)
        model = GPT(config_for("tiny", max_seq_len=32, dropout=0.2))
        checkpointing.apply_policy(model, policy)
        torch.manual_seed(1)
        model(x, y).backward()
        grads[policy] = [p.grad.clone() for p in model.parameters()]
    for policy in ("every_block", "selective"):  # bit for bit: the same masks, the same arithmetic
        assert all(torch.equal(a, b) for a, b in zip(grads[policy], grads["none"]))


def test_deepspeed_style_checkpoint_call_matches_plain_backward():
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Dropout(0.1), nn.Linear(16, 16))
    x = torch.randn(4, 16, requires_grad=True)
    torch.manual_seed(5)
    checkpointing.checkpoint(block, x).sum().backward()
    ckpt = (x.grad.clone(), [p.grad.clone() for p in block.parameters()])
    x.grad = None
    block.zero_grad()
    torch.manual_seed(5)
    block(x).sum().backward()
    assert torch.equal(ckpt[0], x.grad)
    assert all(torch.equal(a, p.grad) for a, p in zip(ckpt[1], block.parameters()))


def test_unknown_policy_is_a_config_error():
    from zerotron.config import Config

    with pytest.raises(ConfigError, match="zerotron.checkpoint_policy.*every_block"):
        Config.load(ds_config(1, 1, zerotron={"checkpoint_policy": "some"}))


# ---- every strategy, with and without ---------------------------------------------------------------
def _train(zero_stage, tp, policy, extra=None, gas=1, steps=STEPS):
    import torch.distributed as dist

    world = dist.get_world_size()
    config = ds_config(
        2,
        gas,
        zero_optimization={"stage": zero_stage, "stage3_param_persistence_threshold": 0},
        tensor_parallel={"autotp_size": tp},
        zerotron={"checkpoint_policy": policy},
        **(extra or {}),
    )
    engine, *_ = zerotron.initialize(model=make_model(n_kv_head=4, dropout=0.0), config=config)
    dp = world // tp
    losses = [
        engine.train_batch(iter(micro_batches(b, engine.coords.dp, dp, gas))).item()
        for b in global_batches(steps, 2 * gas * dp)
    ]
    return losses, zerotron.zero.consolidated_state_dict(engine.module)


@pytest.mark.parametrize(
    "stage,tp,policy,extra",
    [
        (0, 1, "every_block", None),
        (1, 1, "selective", None),
        (2, 1, "every_k", None),
        (3, 1, "every_block", None),
        (3, 1, "selective", None),
        (0, 2, "every_block", {"activation_checkpointing": {"partition_activations": True}}),
        (1, 2, "selective", {"activation_checkpointing": {"partition_activations": True, "cpu_checkpointing": True}}),
    ],
)
def test_parity_with_checkpointing(stage, tp, policy, extra):
    world = 2
    ref_losses, ref_state = reference_training(global_batches(STEPS, 2 * (world // tp)), n_kv_head=4)
    for losses, state in run_ranks(_train, world, stage, tp, policy, extra):
        assert_losses_close(losses, ref_losses, rtol=1e-5)
        assert max_weight_diff(state, ref_state) < 1e-5


def _pipeline(policy, interval):
    module = to_pipeline(
        make_model(n_layer=4, n_kv_head=4),
        2,
        partition_method="type:_PipeBlock",
        activation_checkpoint_interval=interval,
    )
    engine, *_ = zerotron.initialize(model=module, config=ds_config(1, 4, zerotron={"checkpoint_policy": policy}))
    return [engine.train_batch(iter(micro_batches(b, 0, 1, 4))).item() for b in global_batches(STEPS, 4)]


@pytest.mark.parametrize("policy,interval", [("every_block", 0), ("none", 2)])
def test_pipeline_stages_with_checkpointing(policy, interval):
    ref_losses, _ = reference_training(global_batches(STEPS, 4), n_layer=4, n_kv_head=4)
    for losses in run_ranks(_pipeline, 2, policy, interval):
        assert_losses_close(losses, ref_losses, rtol=1e-5)


# ---- the model calls checkpoint itself (DeepSpeed / Megatron style) ------------------------------
class SelfCheckpointing(GPT):
    """A GPT whose forward checkpoints each block call (module __call__, so ZeRO-3's hooks run in
    the recomputation too)."""

    def forward(self, tokens, targets=None):
        from zerotron.models.gpt import rotary_tables

        x = self.tok_emb(tokens)
        cos, sin = rotary_tables(self.config, tokens.shape[1], tokens.device)
        for layer in self.layers:
            x = checkpointing.checkpoint(layer, x, cos, sin)
        return self.loss_fn(self.lm_head(self.norm(x)), targets)


def _self_checkpointing(stage, early_stop=True):
    torch.manual_seed(0)
    model = SelfCheckpointing(config_for("tiny", max_seq_len=16, n_kv_head=4))
    config = ds_config(
        2,
        1,
        zero_optimization={"stage": stage, "stage3_param_persistence_threshold": 0},
        activation_checkpointing={"partition_activations": False},
    )
    engine, *_ = zerotron.initialize(model=model, config=config)
    assert checkpointing.is_configured()
    # Without early stop the recomputation runs the whole block, ZeRO-3's post-forward hook included.
    with torch.utils.checkpoint.set_checkpoint_early_stop(early_stop):
        losses = [
            engine.train_batch(iter(micro_batches(b, engine.coords.dp, 2, 1))).item() for b in global_batches(STEPS, 4)
        ]
    return losses, zerotron.zero.consolidated_state_dict(engine.module)


@pytest.mark.parametrize("stage,early_stop", [(0, True), (3, True), (3, False)])
def test_model_calling_checkpoint_itself_under_zero(stage, early_stop):
    ref_losses, ref_state = reference_training(global_batches(STEPS, 4), n_kv_head=4)
    for losses, state in run_ranks(_self_checkpointing, 2, stage, early_stop):
        assert_losses_close(losses, ref_losses, rtol=1e-5)
        assert max_weight_diff(state, ref_state) < 1e-5


def _partitioned_saved_bytes(partition):
    import torch.distributed as dist

    config = ds_config(
        2,
        1,
        tensor_parallel={"autotp_size": 2},
        zerotron={"checkpoint_policy": "every_block"},
        activation_checkpointing={"partition_activations": partition},
    )
    engine, *_ = zerotron.initialize(model=make_model(n_kv_head=4), config=config)
    x, y = global_batches(1, 2)[0]
    kept = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: kept.append(t) or t, lambda t: t):
        loss = engine(x, y)
    engine.backward(loss)
    dist.barrier()
    block_inputs = [t for t in kept if t.dim() <= 1 and t.numel() in (2 * 16 * 64, 2 * 16 * 64 // 2)]
    return sorted({t.numel() for t in block_inputs})


def test_partitioned_activations_keep_one_slice_per_tensor_parallel_rank():
    full = 2 * 16 * 64  # micro-batch x sequence x d_model
    assert run_ranks(_partitioned_saved_bytes, 2, True)[0] == [full // 2]
