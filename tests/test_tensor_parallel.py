"""Tensor parallelism (and sequence parallelism) trains the same model as one process."""

import pytest
import torch
import torch.distributed as dist
from distributed import RankError, run_ranks
from parity import (
    SEQ,
    assert_losses_close,
    ds_config,
    global_batches,
    make_model,
    max_weight_diff,
    micro_batches,
    reference_training,
)

import zerotron

STEPS = 4


def _train_tp(tp, micro, gas, steps, sequence_parallel=False, stage=0, model_overrides=None):
    world = dist.get_world_size()
    config = ds_config(
        micro,
        gas,
        tensor_parallel={"autotp_size": tp},
        zerotron={"sequence_parallel": sequence_parallel},
        zero_optimization={"stage": stage, "stage3_param_persistence_threshold": 0},
    )
    engine, *_ = zerotron.initialize(model=make_model(**(model_overrides or {})), config=config)
    dp, dp_rank = world // tp, engine.coords.dp
    losses = []
    for b in global_batches(steps, micro * gas * dp):
        engine.reset_comm_stats()
        losses.append(engine.train_batch(iter(micro_batches(b, dp_rank, dp, gas))).item())
    stats = engine.tp_comm.stats()  # the last step's traffic (consolidating the weights below gathers too)
    return losses, zerotron.zero.consolidated_state_dict(engine.module), stats


@pytest.mark.parametrize(
    "world,tp,gas,sp",
    [(2, 2, 1, False), (2, 2, 2, True), (4, 4, 1, False), (4, 4, 1, True), (4, 2, 2, False), (4, 2, 1, True)],
)
def test_parity_with_single_process(world, tp, gas, sp):
    overrides = {"n_kv_head": 4}  # 4 key/value heads split over up to 4 ranks
    ref_losses, ref_state = reference_training(global_batches(STEPS, 2 * gas * (world // tp)), **overrides)
    for losses, state, _ in run_ranks(_train_tp, world, tp, 2, gas, STEPS, sp, 0, overrides):
        assert_losses_close(losses, ref_losses, rtol=1e-5)
        assert max_weight_diff(state, ref_state) < 1e-5


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_tensor_parallel_with_zero_over_data_parallel(stage):
    ref_losses, ref_state = reference_training(global_batches(STEPS, 4), tie_embeddings=True)
    for losses, state, _ in run_ranks(_train_tp, 4, 2, 2, 1, STEPS, False, stage, {"tie_embeddings": True}):
        assert_losses_close(losses, ref_losses, rtol=1e-5)
        assert max_weight_diff(state, ref_state) < 1e-5


def test_one_all_reduce_per_block_in_forward_and_in_backward():
    layers, micro, d = 2, 2, 64
    stats = run_ranks(_train_tp, 2, 2, micro, 1, 1)[0][2]
    activation = micro * SEQ * d * 4
    # forward: embedding + (attention, MLP) per layer; backward: the same two per layer + the head's
    # input. The loss adds three (tokens,)-sized sums (max, sum of exponentials, target logit).
    expected = (1 + 2 * layers) * activation + (2 * layers + 1) * activation + 3 * micro * SEQ * 4
    assert stats["all_reduce"] == expected
    assert stats["all_gather"] == 0 and stats["reduce_scatter"] == 0


def test_sequence_parallel_trades_all_reduces_for_gather_and_scatter():
    layers, micro, d = 2, 2, 64
    stats = run_ranks(_train_tp, 2, 2, micro, 1, 1, True)[0][2]
    activation = micro * SEQ * d * 4
    assert stats["all_gather"] == (4 * layers + 2) * activation
    assert stats["reduce_scatter"] == (4 * layers + 2) * activation
    # what is left: the loss's statistics and the norm weights' gradient sums (2 per layer + final)
    assert stats["all_reduce"] == 3 * micro * SEQ * 4 + (2 * layers + 1) * d * 4


def _bad_heads():
    config = ds_config(2, 1, tensor_parallel={"autotp_size": 4})
    zerotron.initialize(model=make_model(), config=config)  # 2 key/value heads over 4 ranks


def _shapes_moved_to_the_device():
    """The shape of every tensor moved to a device (a `.to(device...)`) while the engine is built,
    and the whole and local shapes of the parameters tensor parallelism splits."""
    from torch.overrides import TorchFunctionMode

    class Moves(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.shapes = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.Tensor.to and (
                kwargs.get("device") is not None or any(isinstance(a, (torch.device, str)) for a in args[1:])
            ):
                self.shapes.append(tuple(args[0].shape))
            return func(*args, **kwargs)

    model = make_model(n_kv_head=4)
    whole = {name: tuple(p.shape) for name, p in model.named_parameters()}
    with Moves() as moves:
        engine, *_ = zerotron.initialize(model=model, config=ds_config(4, 1, tensor_parallel={"autotp_size": 2}))
    split = {
        name: (whole[name], tuple(p.shape))
        for name, p in engine.module.named_parameters()
        if tuple(p.shape) != whole[name]
    }
    return moves.shapes, split


def test_only_the_local_shards_reach_the_device():
    """The model is split where it was built and then placed: a model that needs tensor
    parallelism may not fit the device whole (the plan probe runs the whole model there too)."""
    moved, split = run_ranks(_shapes_moved_to_the_device, 2)[0]
    assert split and moved
    for name, (whole, local) in split.items():
        assert whole not in moved, f"{name} reached the device whole {whole}"
        assert local in moved, name


def test_heads_not_divisible_is_a_clear_error():
    with pytest.raises(RankError, match=r"key/value heads \(2\) must be divisible"):
        run_ranks(_bad_heads, 4)


def _logits_and_padded_loss():
    config = ds_config(2, 1, tensor_parallel={"autotp_size": 2})
    engine, *_ = zerotron.initialize(model=make_model(n_kv_head=4), config=config)
    x, y = global_batches(1, 2)[0]
    y[:, :5] = -100  # padding labels, as Hugging Face collators write them
    loss = engine(x, y).item()
    with torch.no_grad():
        logits = engine(x)
    return loss, logits


def test_returned_logits_are_whole_and_ignored_labels_are_ignored():
    ref = make_model(n_kv_head=4)
    x, y = global_batches(1, 2)[0]
    y[:, :5] = -100
    ref_loss, ref_logits = ref(x, y).item(), ref(x).detach()
    for loss, logits in run_ranks(_logits_and_padded_loss, 2):
        assert loss == pytest.approx(ref_loss, rel=1e-5)
        assert logits.shape == ref_logits.shape
        torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)
