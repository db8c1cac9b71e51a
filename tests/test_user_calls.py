"""The calls real scripts make, in the order they make them, each against single-process training:
parameters and optimizers handed in every way DeepSpeed accepts (under tensor parallelism too),
`loss.backward()` instead of `engine.backward`, a resume under another accumulation, and a
pipeline stage whose first layer works in place."""

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from distributed import RankError, run_ranks
from parity import (
    EPS,
    LR,
    Dense,
    assert_losses_close,
    ds_config,
    global_batches,
    make_model,
    max_weight_diff,
    micro_batches,
    param_groups,
    reference_training,
)

import zerotron

STEPS = 3
MODEL = {"n_kv_head": 4}  # 4 key/value heads: splits over 2 tensor-parallel ranks


def _adamw(params):
    return torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), eps=EPS, weight_decay=0.1)


# (how the parameters / optimizer reach initialize, whether they form two groups)
HANDED_IN = {
    "nothing": False,  # initialize(model=m, config=cfg)
    "generator": False,  # model_parameters=m.parameters()  (every DeepSpeed example)
    "list": False,  # model_parameters=list(m.parameters())
    "groups": True,  # model_parameters=[{"params": ..., "weight_decay": ...}, ...]
    "client": False,  # optimizer=torch.optim.AdamW(m.parameters()) built before initialize
    "client_groups": True,  # the same with two groups
    "callable": True,  # optimizer=lambda params: AdamW(params), params from model_parameters
}


def _train_handed_in(how, tp, stage, gas, overlap=False):
    world = dist.get_world_size()
    model = make_model(**MODEL)
    extra = {
        "tensor_parallel": {"autotp_size": tp, "tp_overlap_comm": overlap},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    config = ds_config(2, gas, **extra)
    kwargs = {}
    if how == "generator":
        kwargs["model_parameters"] = model.parameters()
    elif how == "list":
        kwargs["model_parameters"] = list(model.parameters())
    elif how == "groups":
        kwargs["model_parameters"] = param_groups(model)
    elif how in ("client", "client_groups", "callable"):
        config.pop("optimizer")
        if how == "callable":
            kwargs.update(optimizer=_adamw, model_parameters=param_groups(model))
        else:
            kwargs["optimizer"] = _adamw(param_groups(model) if how == "client_groups" else model.parameters())
    engine, optimizer, *_ = zerotron.initialize(model=model, config=config, **kwargs)
    dp = world // tp
    losses = [
        engine.train_batch(iter(micro_batches(b, engine.coords.dp, dp, gas))).item()
        for b in global_batches(STEPS, 2 * gas * dp)
    ]
    trained = sum(p.numel() for g in optimizer.param_groups for p in g["params"])
    return losses, zerotron.zero.consolidated_state_dict(engine.module), trained


@pytest.mark.parametrize("how", list(HANDED_IN))
@pytest.mark.parametrize("world,tp,stage,gas,overlap", [(2, 2, 0, 1, False), (4, 2, 3, 2, False), (2, 2, 1, 2, True)])
def test_every_way_of_handing_in_parameters_trains_the_whole_model(how, world, tp, stage, gas, overlap):
    ref_losses, ref_state = reference_training(
        global_batches(STEPS, 2 * gas * (world // tp)), groups=param_groups if HANDED_IN[how] else None, **MODEL
    )
    for losses, state, _ in run_ranks(_train_handed_in, world, how, tp, stage, gas, overlap):
        assert_losses_close(losses, ref_losses, rtol=1e-5)
        assert max_weight_diff(state, ref_state) < 1e-5


def _subset_without_freezing():
    model = make_model()
    engine, *_ = zerotron.initialize(
        model=model, config=ds_config(2, 1), model_parameters=list(model.layers.parameters())
    )
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for batch in global_batches(2, 2):  # the first gradient of a parameter left out is warned about, once
            engine.train_batch(iter([batch]))
    said = [str(w.message) for w in record if "no optimizer group" in str(w.message)]
    same = {n: torch.equal(before[n], p.detach()) for n, p in model.named_parameters()}
    return said, same


def _foreign_parameter():
    model = make_model()
    zerotron.initialize(
        model=model, config=ds_config(2, 1), model_parameters=list(model.parameters()) + [nn.Parameter(torch.zeros(3))]
    )


def test_a_parameter_in_no_optimizer_group_stays_as_it_is_and_is_named():
    """As in DeepSpeed (bing_bert's pre-training leaves BERT's pooler out of its groups, and its loss reaches it)."""
    for said, same in run_ranks(_subset_without_freezing, 2):
        assert len(said) == 1 and "tok_emb.weight" in said[0] and "stays as it is, as in DeepSpeed" in said[0]
        assert same["tok_emb.weight"] and not same["layers.0.attn.wq.weight"]
    with pytest.raises(RankError, match=r"shape \(3,\) that is not a parameter of the model"):
        run_ranks(_foreign_parameter, 2)


def _frozen_subset():
    """Freezing what is not handed in is the way to train part of a model."""
    model = make_model()
    model.tok_emb.weight.requires_grad_(False)
    engine, optimizer, *_ = zerotron.initialize(
        model=model, config=ds_config(2, 1), model_parameters=[p for p in model.parameters() if p.requires_grad]
    )
    before = model.tok_emb.weight.detach().clone()
    x, y = global_batches(1, 2)[0]
    engine.train_batch(iter([(x, y)]))
    return torch.equal(before, model.tok_emb.weight.detach())


def test_frozen_parameters_may_stay_out_of_the_optimizer():
    assert run_ranks(_frozen_subset, 2) == [True, True]


def _unused_left_out():
    """BingBertSquad hands DeepSpeed every parameter but BERT's pooler, which its loss never uses:
    the same training as handing in all of them, at every stage."""
    losses = {}
    for stage in (0, 2, 3):
        for left_out in (False, True):
            model = make_model()
            model.pooler = nn.Linear(8, 8)  # registered, never called by forward
            params = [p for n, p in model.named_parameters() if not (left_out and n.startswith("pooler"))]
            zero = {"stage": stage, "stage3_param_persistence_threshold": 0}
            engine, *_ = zerotron.initialize(
                model=model, config=ds_config(2, 1, zero_optimization=zero), model_parameters=params
            )
            losses[stage, left_out] = [engine.train_batch(iter([b])).item() for b in global_batches(STEPS, 2)]
    return losses


def test_an_unused_parameter_may_stay_out_of_the_optimizer():
    for losses in run_ranks(_unused_left_out, 2):
        for stage in (0, 2, 3):
            assert losses[stage, True] == losses[stage, False], stage


# ---- loss.backward() instead of engine.backward --------------------------------------------------
def _train_backward(stage, gas, direct: bool, precision="fp32"):
    extra = {"zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    if precision == "fp16":
        extra["fp16"] = {"enabled": True}
    engine, *_ = zerotron.initialize(model=make_model(), config=ds_config(2, gas, **extra))
    losses = []
    for b in global_batches(STEPS, 2 * gas * 2):
        for x, y in micro_batches(b, dist.get_rank(), 2, gas):
            loss = engine(x, y)
            if direct:
                loss.backward()
            else:
                engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    return losses, zerotron.zero.consolidated_state_dict(engine.module)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("gas", [1, 2])
def test_loss_backward_without_engine_backward_trains_the_same_weights(stage, gas):
    wanted = run_ranks(_train_backward, 2, stage, gas, False)
    for (losses, state), (want, want_state) in zip(run_ranks(_train_backward, 2, stage, gas, True), wanted):
        assert_losses_close(losses, want, rtol=1e-6)
        assert max_weight_diff(state, want_state) < 1e-6


def test_loss_backward_with_fp16_asks_for_engine_backward():
    with pytest.raises(RankError, match=r"call engine.backward\(loss\) instead of loss.backward\(\)"):
        run_ranks(_train_backward, 2, 1, 1, True, "fp16")


# ---- resume under another accumulation -----------------------------------------------------------
def _train_then_save(directory, steps, save: bool, load: bool):
    """train_batch_size 8 whatever the world: 1 micro-batch per step on 4 ranks, 2 on 2 ranks."""
    world = dist.get_world_size()
    gas = 8 // (2 * world)
    engine, *_ = zerotron.initialize(model=make_model(), config=ds_config(2, gas))
    if load:
        engine.load_checkpoint(directory)
    for b in global_batches(6, 8)[engine.global_steps : engine.global_steps + steps]:
        for x, y in micro_batches(b, engine.coords.dp, world, gas):  # engine.backward/step, as scripts do
            engine.backward(engine(x, y))
            engine.step()
    if save:
        engine.save_checkpoint(directory)
    return engine.global_steps, zerotron.zero.consolidated_state_dict(engine.module)


def test_resume_under_another_accumulation_stands_at_a_boundary(tmp_path):
    d = str(tmp_path / "ck")
    run_ranks(_train_then_save, 4, d, 3, True, False)  # accumulation 1
    steps, resumed = run_ranks(_train_then_save, 2, d, 3, False, True)[0]  # accumulation 2
    _, straight = run_ranks(_train_then_save, 4, d + "_straight", 6, False, False)[0]
    assert steps == 6
    assert max_weight_diff(resumed, straight) < 1e-5


# ---- pipelines -----------------------------------------------------------------------------------
def _pipeline_with_inplace_first_layer(stages):
    from zerotron.pipe import LayerSpec, PipelineModule

    # the second stage starts with ReLU(inplace=True), as DeepSpeed's AlexNet pipeline example can
    specs = [LayerSpec(Dense, 8), LayerSpec(nn.Linear, 8, 8), LayerSpec(nn.ReLU, inplace=True), LayerSpec(Dense, 8)]
    module = PipelineModule(
        specs, num_stages=stages, loss_fn=nn.functional.mse_loss, seed_layers=True, partition_method="uniform"
    )
    engine, *_ = zerotron.initialize(model=module, config=ds_config(2, 2))
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(2, 8, generator=g), torch.randn(2, 8, generator=g)) for _ in range(2 * STEPS)]
    return [engine.train_batch(iter(batches[2 * i : 2 * i + 2])).item() for i in range(STEPS)]


def test_a_stage_may_modify_its_received_activation_in_place():
    want = run_ranks(_pipeline_with_inplace_first_layer, 1, 1)[0]
    for losses in run_ranks(_pipeline_with_inplace_first_layer, 2, 2):
        assert_losses_close(losses, want, rtol=1e-6)
