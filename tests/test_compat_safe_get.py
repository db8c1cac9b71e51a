"""`deepspeed.utils.safe_get/set_full_*` (zerotron/compat): under ZeRO 0-3 on two ranks against one
process, under bf16 and fp16, under offload, and outside an engine."""

import pytest
import torch
from distributed import run_ranks
from parity import EPS, LR, ds_config, global_batches, make_model, micro_batches

import zerotron
from zerotron.compat import utils
from zerotron.compat.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
from zerotron.compat.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

# ---- safe_get/set_full_*: ZeRO 0-3 on two ranks against one process ------------------------------------
SET_NAMES = ("layers.0.attn.wq.weight", "layers.1.mlp_norm.weight", "lm_head.weight")


def _set_values(named_shapes):
    g = torch.Generator().manual_seed(11)
    return {n: torch.randn(shape, generator=g) * 0.05 for n, shape in named_shapes}


def _safe_functions_under_every_stage():
    from zerotron.zero import consolidated_state_dict

    batches = global_batches(2, 4)
    shapes = {n: p.shape for n, p in make_model().named_parameters()}  # (ZeRO-3 parameters read as empty)
    out = {}
    for stage in (0, 1, 2, 3):
        zero = {"stage": stage}
        if stage == 3:  # matrices partitioned, norm weights kept whole: both kinds of ZeRO-3 parameters
            zero["stage3_param_persistence_threshold"] = 100
        engine, *_ = zerotron.initialize(model=make_model(), config=ds_config(2, 1, zero_optimization=zero))
        rank = engine.coords.dp
        ((x, y),) = micro_batches(batches[0], rank, 2, 1)
        engine.backward(engine(x, y))
        engine.step()
        ((x, y),) = micro_batches(batches[1], rank, 2, 1)
        engine.backward(engine(x, y))  # the second step's gradients, before its step
        params = dict(engine.module.named_parameters())
        traffic = engine.comm_stats()
        r = {
            "param": {n: utils.safe_get_full_fp32_param(p).cpu() for n, p in params.items()},
            "grad": {n: utils.safe_get_full_grad(p).cpu() for n, p in params.items()},
            "exp_avg": {n: utils.safe_get_full_optimizer_state(p, "exp_avg").cpu() for n, p in params.items()},
            "exp_avg_sq": {n: utils.safe_get_full_optimizer_state(p, "exp_avg_sq").cpu() for n, p in params.items()},
            "step": float(utils.safe_get_full_optimizer_state(params["norm.weight"], "step")),
            "missing_state": utils.safe_get_full_optimizer_state(params["norm.weight"], "nothing"),
            "local_numel": {n: utils.safe_get_local_fp32_param(p).numel() for n, p in params.items()},
            "not_ours": utils.safe_get_full_fp32_param(torch.nn.Parameter(torch.zeros(2))),
            "zero3": isinstance(engine.optimizer, DeepSpeedZeroOptimizer_Stage3),
            "zero12": isinstance(engine.optimizer, DeepSpeedZeroOptimizer),
        }
        r["not_training_traffic"] = engine.comm_stats() == traffic
        r["consolidated"] = consolidated_state_dict(engine.module)
        # Setting: the fp32 master and the weights every rank computes with.
        values = _set_values((n, shapes[n]) for n in SET_NAMES)
        for n in SET_NAMES:
            utils.safe_set_full_fp32_param(params[n], values[n])
        x_eval, y_eval = batches[1][0][:2], batches[1][1][:2]
        with torch.no_grad():
            r["loss_after_set"] = float(engine(x_eval, y_eval))
        r["param_after_set"] = {n: utils.safe_get_full_fp32_param(params[n]).cpu() for n in SET_NAMES}
        r["consolidated_after_set"] = {
            n: v for n, v in consolidated_state_dict(engine.module).items() if n in SET_NAMES
        }
        target = params["layers.1.attn.wk.weight"]
        state = values["layers.0.attn.wq.weight"][:32] + 1.0
        utils.safe_set_full_optimizer_state(target, state, "exp_avg")
        r["state_after_set"] = utils.safe_get_full_optimizer_state(target, "exp_avg").cpu()
        utils.safe_set_full_grad(target, state * 2)
        r["grad_after_set"] = utils.safe_get_full_grad(target).cpu()
        with pytest.raises(KeyError, match="no state"):
            utils.safe_set_full_optimizer_state(target, state, "nothing")
        out[stage] = r
        del engine, params, target
    return out


def _single_process_reference():
    """One AdamW step on batch 0 (clipped), then the gradients of batch 1: what the engines hold."""
    batches = global_batches(2, 4)
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), eps=EPS, weight_decay=0.1, fused=True)
    x, y = batches[0]
    model(x, y).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
    names = dict(model.named_parameters())
    ref = {
        "param": {n: p.detach().clone() for n, p in names.items()},
        "exp_avg": {n: opt.state[p]["exp_avg"].clone() for n, p in names.items()},
        "exp_avg_sq": {n: opt.state[p]["exp_avg_sq"].clone() for n, p in names.items()},
    }
    x, y = batches[1]
    model(x, y).backward()
    ref["grad"] = {n: p.grad.clone() for n, p in names.items()}
    return ref


@pytest.fixture(scope="module")
def safe_results():
    return run_ranks(_safe_functions_under_every_stage, 2, timeout=180), _single_process_reference()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_safe_get_full_values_equal_one_process(safe_results, stage):
    results, ref = safe_results
    for rank, r in enumerate(results):
        r = r[stage]
        for n, v in r["consolidated"].items():  # exactly the full weights, on every rank
            assert torch.equal(r["param"][n], v), (stage, rank, n)
        for kind, tol in (("param", 1e-6), ("grad", 1e-6), ("exp_avg", 1e-7), ("exp_avg_sq", 1e-9)):
            for n, want in ref[kind].items():
                assert r[kind][n].shape == want.shape, (stage, kind, n)
                torch.testing.assert_close(r[kind][n], want, rtol=1e-4, atol=tol, msg=f"stage {stage} {kind} {n}")
        assert r["step"] == 1.0 and r["missing_state"] is None and r["not_ours"] is None
        assert r["zero3"] == (stage == 3) and r["zero12"] == (stage in (1, 2))
        assert r["not_training_traffic"]  # engine.comm_stats() counts training only
    total = {n: sum(results[k][stage]["local_numel"][n] for k in range(2)) for n in ref["param"]}
    numel = {n: ref["param"][n].numel() * (2 if stage == 0 else 1) for n in ref["param"]}  # stage 0: replicated
    assert total == numel


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_safe_set_full_fp32_param_changes_the_next_forward(safe_results, stage):
    results, _ = safe_results
    model = make_model()
    model.load_state_dict(results[0][stage]["consolidated"])
    values = _set_values((n, p.shape) for n, p in model.named_parameters() if n in SET_NAMES)
    x, y = (t[:2] for t in global_batches(2, 4)[1])
    with torch.no_grad():
        before = float(model(x, y))
        for n, p in model.named_parameters():
            if n in SET_NAMES:
                p.copy_(values[n])
        want = float(model(x, y))
    for r in results:
        r = r[stage]
        assert r["loss_after_set"] == pytest.approx(want, rel=1e-6) and abs(want - before) > 1e-3
        for n in SET_NAMES:
            assert torch.equal(r["param_after_set"][n], values[n]) and torch.equal(
                r["consolidated_after_set"][n], values[n]
            )
        state = values["layers.0.attn.wq.weight"][:32] + 1.0
        assert torch.equal(r["state_after_set"], state)
        torch.testing.assert_close(r["grad_after_set"], state * 2)


def _mixed_precision_values():
    from zerotron.zero import consolidated_state_dict

    batches = global_batches(2, 4)
    out = {}
    for name, stage, precision in (
        ("bf16-0", 0, {"bf16": {"enabled": True}}),
        ("bf16-2", 2, {"bf16": {"enabled": True}}),
        ("fp16-3", 3, {"fp16": {"enabled": True, "initial_scale_power": 12}}),
    ):
        zero = {"stage": stage, "stage3_param_persistence_threshold": 100}
        engine, *_ = zerotron.initialize(
            model=make_model(), config=ds_config(2, 1, zero_optimization=zero, **precision)
        )
        ((x, y),) = micro_batches(batches[0], engine.coords.dp, 2, 1)
        engine.backward(engine(x, y))
        engine.step()
        ((x, y),) = micro_batches(batches[1], engine.coords.dp, 2, 1)
        engine.backward(engine(x, y))
        params = dict(engine.module.named_parameters())
        out[name] = {
            "master": {n: utils.safe_get_full_fp32_param(p).cpu() for n, p in params.items()},
            "grad": {n: utils.safe_get_full_grad(p).cpu() for n, p in params.items()},
            "weights": consolidated_state_dict(engine.module),
            "scale": engine.loss_scale,
        }
        del engine, params
    return out


def test_safe_get_under_bf16_and_fp16_gives_fp32_masters_and_unscaled_gradients():
    results = run_ranks(_mixed_precision_values, 2, timeout=120)
    x, y = global_batches(2, 4)[1]
    for name in ("bf16-0", "bf16-2", "fp16-3"):
        r = results[0][name]
        assert torch.equal(r["master"]["norm.weight"], results[1][name]["master"]["norm.weight"])
        low = next(iter(r["weights"].values())).dtype
        assert low == (torch.float16 if name.startswith("fp16") else torch.bfloat16), name
        moved = 0
        for n, w in r["weights"].items():
            m = r["master"][n]
            assert m.dtype == torch.float32 and torch.equal(m.to(low), w), (name, n)  # the weights are the masters
            moved += int((m != w.float()).sum())
        assert moved > 0, name  # the masters keep what the low-precision weights cannot
        # the gradient the optimizer will see: that of the loss at these weights, not times the loss scale
        model = make_model()
        model.load_state_dict({n: w.float() for n, w in r["weights"].items()})
        model(x, y).backward()
        got = torch.cat([r["grad"][n].reshape(-1) for n, _ in model.named_parameters()])
        want = torch.cat([p.grad.reshape(-1) for _, p in model.named_parameters()])
        assert float((got - want).norm() / want.norm()) < 0.05, name
        assert r["scale"] == (2.0**12 if name.startswith("fp16") else 1.0)


def _offloaded_gradient_and_weight_edits():
    from zerotron.zero import consolidated_state_dict

    batches = global_batches(2, 4)
    out = {}
    for stage in (2, 3):
        zero = {"stage": stage, "offload_optimizer": {"device": "cpu"}, "stage3_param_persistence_threshold": 100}
        if stage == 3:
            zero["offload_param"] = {"device": "cpu"}
        engine, *_ = zerotron.initialize(model=make_model(), config=ds_config(2, 1, zero_optimization=zero))
        for i, batch in enumerate(batches):
            ((x, y),) = micro_batches(batch, engine.coords.dp, 2, 1)
            engine.backward(engine(x, y))
            if i == 0:
                engine.step()
        p = dict(engine.module.named_parameters())["layers.0.attn.wq.weight"]
        momentum = utils.safe_get_full_optimizer_state(p, "exp_avg").clone()
        # the gradient has already left for the host: the edit must reach the host-side step too
        utils.safe_set_full_grad(p, torch.zeros(64, 64))
        engine.step()
        r = {
            "momentum_decayed": torch.allclose(
                utils.safe_get_full_optimizer_state(p, "exp_avg"), 0.9 * momentum, rtol=1e-6, atol=0
            )
        }
        new = torch.full((64, 64), 0.01)
        utils.safe_set_full_fp32_param(p, new)
        r["weights_set"] = torch.equal(consolidated_state_dict(engine.module)["layers.0.attn.wq.weight"], new)
        out[stage] = r
        del engine, p
    return out


def test_safe_set_under_offload_reaches_the_host_step_and_the_weights():
    for r in run_ranks(_offloaded_gradient_and_weight_edits, 2, timeout=120):
        assert r == {
            2: {"momentum_decayed": True, "weights_set": True},
            3: {"momentum_decayed": True, "weights_set": True},
        }


def test_safe_functions_return_none_outside_an_engine():
    p = torch.nn.Parameter(torch.ones(3))
    assert utils.safe_get_full_fp32_param(p) is None and utils.safe_get_full_grad(p) is None
    assert utils.safe_get_full_optimizer_state(p, "exp_avg") is None and utils.safe_get_local_fp32_param(p) is None
