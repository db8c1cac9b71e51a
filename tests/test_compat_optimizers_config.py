"""DeepSpeed's optimizers (zerotron.ops) against references, ZeRO's elementwise check (trusted
classes, the probe, zero_allow_untested_optimizer), and DeepSpeed config compatibility."""

import json
import math
import warnings

import pytest
import torch
import torch.distributed as dist
from distributed import RankError, run_ranks
from parity import assert_losses_close, global_batches, make_model, max_weight_diff, micro_batches

import zerotron
from zerotron import Config, ConfigError
from zerotron.ops.adagrad import DeepSpeedCPUAdagrad
from zerotron.ops.adam import CPUAdam, DeepSpeedCPUAdam, FusedAdam
from zerotron.ops.lamb import FusedLamb
from zerotron.ops.lion import DeepSpeedCPULion, FusedLion
from zerotron.optim import build_optimizer, check_shardable, probe_elementwise

STEPS = 3


# =============================================================================== helpers
def _problem(seed=0, shapes=((6, 5), (7,)), steps=4):
    g = torch.Generator().manual_seed(seed)
    init = [torch.randn(s, generator=g) for s in shapes]
    grads = [[torch.randn(s, generator=g) for s in shapes] for _ in range(steps)]
    return init, grads


def _train(make, init, grads, dtype=torch.float32):
    """Parameters after one step per gradient list, with the optimizer `make(params)` builds."""
    params = [torch.nn.Parameter(t.clone().to(dtype)) for t in init]
    opt = make(params)
    for gs in grads:
        for p, g in zip(params, gs):
            p.grad = g.clone().to(dtype)
        opt.step()
    return [p.detach().clone() for p in params], opt


def _max_diff(a, b):
    return max((x.double() - y.double()).abs().max().item() for x, y in zip(a, b))


def _messages(record):
    return " | ".join(str(w.message) for w in record)


# =============================================================================== FusedAdam
def _adam_reference(init, grads, lr, betas, eps, weight_decay, adamw, bias_correction):
    """DeepSpeed's FusedAdam kernel, element by element, in float64."""
    wd = weight_decay
    b1, b2 = betas
    out = []
    for i, p in enumerate(init):
        p, m, v = p.double().clone(), torch.zeros_like(p, dtype=torch.float64), torch.zeros_like(p, dtype=torch.float64)
        for t, gs in enumerate(grads, 1):
            g = gs[i].double()
            if not adamw:
                g = g + wd * p
            m = b1 * m + (1 - b1) * g
            v = b2 * v + (1 - b2) * g * g
            c1, c2 = (1 - b1**t, 1 - b2**t) if bias_correction else (1.0, 1.0)
            update = (m / c1) / ((v / c2).sqrt() + eps)
            if adamw:
                update = update + wd * p
            p = p - lr * update
        out.append(p)
    return out


HYPER = dict(lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_fused_adam_with_bias_correction_is_torch_fused_adam_bit_for_bit(adam_w_mode):
    init, grads = _problem()
    ours, _ = _train(lambda ps: FusedAdam(ps, adam_w_mode=adam_w_mode, **HYPER), init, grads)
    torch_cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    theirs, _ = _train(lambda ps: torch_cls(ps, fused=True, **HYPER), init, grads)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))
    ref = _adam_reference(init, grads, adamw=adam_w_mode, bias_correction=True, **HYPER)
    assert _max_diff(ours, ref) < 1e-6


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_fused_adam_without_bias_correction_matches_the_uncorrected_update(adam_w_mode):
    init, grads = _problem()
    ours, opt = _train(lambda ps: FusedAdam(ps, bias_correction=False, adam_w_mode=adam_w_mode, **HYPER), init, grads)
    ref = _adam_reference(init, grads, adamw=adam_w_mode, bias_correction=False, **HYPER)
    assert _max_diff(ours, ref) < 1e-6
    # ... which is really another update than the corrected one
    corrected = _adam_reference(init, grads, adamw=adam_w_mode, bias_correction=True, **HYPER)
    assert _max_diff(ours, corrected) > 1e-3
    # the real step count is kept
    assert all(opt.state[p]["step"].item() == len(grads) for p in opt.param_groups[0]["params"])


def test_fused_adam_bias_correction_is_per_group():
    init, grads = _problem()
    ours, _ = _train(
        lambda ps: FusedAdam([{"params": [ps[0]], "bias_correction": False}, {"params": [ps[1]]}], **HYPER), init, grads
    )
    no = _adam_reference(init, grads, adamw=True, bias_correction=False, **HYPER)
    yes = _adam_reference(init, grads, adamw=True, bias_correction=True, **HYPER)
    assert _max_diff([ours[0]], [no[0]]) < 1e-6 and _max_diff([ours[1]], [yes[1]]) < 1e-6


def test_fused_adam_refuses_amsgrad_and_sets_grads_to_none():
    p = torch.nn.Parameter(torch.ones(3))
    with pytest.raises(RuntimeError, match="AMSGrad"):
        FusedAdam([p], amsgrad=True)
    p.grad = torch.ones(3)
    FusedAdam([p]).zero_grad()
    assert p.grad is None
    p.grad = torch.ones(3)
    FusedAdam([p], set_grad_none=False).zero_grad()
    assert p.grad is not None and torch.equal(p.grad, torch.zeros(3))


def test_fused_adam_state_dict_round_trip_continues_the_same_training():
    init, grads = _problem(steps=4)
    straight, _ = _train(lambda ps: FusedAdam(ps, bias_correction=False, **HYPER), init, grads)
    first, opt = _train(lambda ps: FusedAdam(ps, bias_correction=False, **HYPER), init, grads[:2])
    params = [torch.nn.Parameter(t) for t in first]
    resumed = FusedAdam(params, bias_correction=False, **HYPER)
    resumed.load_state_dict(opt.state_dict())
    for gs in grads[2:]:
        for p, g in zip(params, gs):
            p.grad = g.clone()
        resumed.step()
    assert all(torch.equal(a, b.detach()) for a, b in zip(straight, params))


def test_deepspeed_cpu_adam_is_there():
    assert DeepSpeedCPUAdam is CPUAdam
    init, grads = _problem()
    ours, _ = _train(lambda ps: DeepSpeedCPUAdam(ps, threads=1, **HYPER), init, grads)
    theirs, _ = _train(lambda ps: torch.optim.AdamW(ps, fused=True, **HYPER), init, grads)
    assert _max_diff(ours, theirs) == 0


# =============================================================================== Lion
def _lion_reference(init, grads, lr, betas, weight_decay):
    wd = weight_decay
    b1, b2 = betas
    out = []
    for i, p in enumerate(init):
        p, m = p.clone(), torch.zeros_like(p)
        for gs in grads:
            g = gs[i]
            c = m * b1 + g * (1 - b1)
            p = p * (1 - lr * wd) - lr * torch.sign(c)
            m = m * b2 + g * (1 - b2)
        out.append(p)
    return out


@pytest.mark.parametrize("cls", [FusedLion, DeepSpeedCPULion])
def test_lion_matches_the_reference_update(cls):
    init, grads = _problem()
    grads[0][1][3] = 0.0  # m = 0 and g = 0: sign(0) = 0, so only weight decay moves this element
    hyper = dict(lr=1e-2, betas=(0.9, 0.99), weight_decay=0.5)
    ours, opt = _train(lambda ps: cls(ps, **hyper), init, grads[:1])
    assert ours[1][3].item() == pytest.approx(init[1][3].item() * (1 - 1e-2 * 0.5), rel=1e-6)
    ours, opt = _train(lambda ps: cls(ps, **hyper), init, grads)
    ref = _lion_reference(init, grads, **hyper)
    assert _max_diff(ours, ref) < 1e-6
    # one step moves every element by exactly lr after the decay (but the one whose c was 0): one step size
    one, _ = _train(lambda ps: cls(ps, **hyper), init, grads[:1])
    moved = torch.cat([(p - q * (1 - 5e-3)).abs().reshape(-1) for p, q in zip(one, init)])
    assert torch.allclose(moved[torch.arange(len(moved)) != 30 + 3], torch.tensor(1e-2), atol=1e-6)


def test_lion_defaults_are_deepspeeds_and_cpu_lion_keeps_fp32_moments():
    p = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    assert FusedLion([p]).defaults == dict(lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0)
    opt = DeepSpeedCPULion([p], lr=0.1)
    p.grad = torch.full((4,), 0.5, dtype=torch.bfloat16)
    opt.step()
    assert opt.state[p]["exp_avg"].dtype == torch.float32 and p.dtype == torch.bfloat16
    assert torch.allclose(p.float(), torch.full((4,), 0.9), atol=4e-3)  # 1 - lr, rounded to bf16
    fused = FusedLion([q := torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))])
    q.grad = torch.ones(4, dtype=torch.bfloat16)
    fused.step()
    assert fused.state[q]["exp_avg"].dtype == torch.bfloat16


# =============================================================================== Adagrad
def _ds_adagrad_reference(init, grads, lr, eps, wd):
    out = []
    for i, p in enumerate(init):
        p, s = p.double().clone(), torch.zeros_like(p, dtype=torch.float64)
        for gs in grads:
            g = gs[i].double()
            s = s + (g + wd * p) ** 2
            p = p - lr * g / (s.sqrt() + eps)
        out.append(p)
    return out


def test_cpu_adagrad_without_decay_is_torch_adagrad():
    init, grads = _problem()
    ours, _ = _train(lambda ps: DeepSpeedCPUAdagrad(ps, lr=0.1, eps=1e-10), init, grads)
    fused, _ = _train(lambda ps: torch.optim.Adagrad(ps, lr=0.1, eps=1e-10, fused=True), init, grads)
    plain, _ = _train(lambda ps: torch.optim.Adagrad(ps, lr=0.1, eps=1e-10), init, grads)
    assert all(torch.equal(a, b) for a, b in zip(ours, fused))
    assert _max_diff(ours, plain) < 1e-6
    assert _max_diff(ours, _ds_adagrad_reference(init, grads, 0.1, 1e-10, 0.0)) < 1e-6


def test_cpu_adagrad_with_decay_is_deepspeeds_form():
    init, grads = _problem()
    ours, _ = _train(lambda ps: DeepSpeedCPUAdagrad(ps, lr=0.1, eps=1e-10, weight_decay=0.3), init, grads)
    assert _max_diff(ours, _ds_adagrad_reference(init, grads, 0.1, 1e-10, 0.3)) < 1e-6
    torchs, _ = _train(lambda ps: torch.optim.Adagrad(ps, lr=0.1, eps=1e-10, weight_decay=0.3), init, grads)
    assert _max_diff(ours, torchs) > 1e-3  # DeepSpeed's numerator is the raw gradient, torch's the decayed one


# =============================================================================== Lamb
def _lamb_reference(init, grads, lr, betas, eps, wd, max_coeff, min_coeff, bias_correction, eps_inside_sqrt):
    b1, b2 = betas
    out, coeffs = [], []
    for i, p in enumerate(init):
        p, m, v = p.double().clone(), torch.zeros_like(p, dtype=torch.float64), torch.zeros_like(p, dtype=torch.float64)
        for t, gs in enumerate(grads, 1):
            g = gs[i].double()
            m = b1 * m + (1 - b1) * g
            v = b2 * v + (1 - b2) * g * g
            denom = (v + eps).sqrt() if eps_inside_sqrt else v.sqrt() + eps
            u = m / denom + wd * p
            w_norm, u_norm = p.norm().item(), u.norm().item()
            r = min(max(w_norm / u_norm, min_coeff), max_coeff) if w_norm > 0 and u_norm > 0 else 1.0
            step = lr * math.sqrt(1 - b2**t) / (1 - b1**t) if bias_correction else lr
            p = p - step * r * u
        coeffs.append(r)
        out.append(p)
    return out, coeffs


@pytest.mark.parametrize("bias_correction,eps_inside_sqrt", [(True, False), (False, True)])
def test_lamb_matches_the_reference_with_a_per_parameter_trust_ratio(bias_correction, eps_inside_sqrt):
    init, grads = _problem(shapes=((6, 5), (7,), (4,), (3,)))
    init[0] = init[0] * 100  # ||w|| / ||u|| far above max_coeff: clamped to it
    init[1] = init[1] * 1e-4  # far below min_coeff: clamped to it
    init[3] = torch.zeros(3)  # ||w|| = 0: the ratio is 1
    hyper = dict(
        lr=1e-2,
        betas=(0.9, 0.999),
        eps=1e-6,
        wd=0.01,
        max_coeff=10.0,
        min_coeff=0.01,
        bias_correction=bias_correction,
        eps_inside_sqrt=eps_inside_sqrt,
    )
    ours, opt = _train(
        lambda ps: FusedLamb(
            ps, lr=1e-2, eps=1e-6, weight_decay=0.01, bias_correction=bias_correction, eps_inside_sqrt=eps_inside_sqrt
        ),
        init,
        grads,
    )
    ref, coeffs = _lamb_reference(init, grads, **hyper)
    for a, b in zip(ours, ref):  # relative to each tensor's scale (one is 100x, one 1e-4x the others)
        assert (a.double() - b).abs().max().item() <= 1e-6 * max(b.abs().max().item(), 1e-3)
    got = opt.get_lamb_coeffs()
    assert got[0] == pytest.approx(10.0) and got[1] == pytest.approx(0.01) and 0.01 < got[2] < 10
    assert got == pytest.approx(coeffs, rel=1e-5)
    _, first = _train(lambda ps: FusedLamb(ps), init, grads[:1])
    assert first.get_lamb_coeffs()[3] == 1.0  # a zero tensor's ratio is 1 (then it is no longer zero)


def test_lamb_refuses_in_optimizer_clipping_and_amsgrad():
    p = [torch.nn.Parameter(torch.ones(2))]
    with pytest.raises(ValueError, match="gradient_clipping"):
        FusedLamb(p, max_grad_norm=1.0)
    with pytest.raises(RuntimeError, match="AMSGrad"):
        FusedLamb(p, amsgrad=True)


# =============================================================================== the elementwise probe
class MomentumSGD(torch.optim.Optimizer):
    """A user's own optimizer on no list: SGD with heavy-ball momentum and decoupled decay."""

    def __init__(self, params, lr=0.05, momentum=0.9, weight_decay=0.0):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].setdefault("buf", torch.zeros_like(p))
                buf.mul_(group["momentum"]).add_(p.grad)
                p.mul_(1 - group["lr"] * group["weight_decay"]).add_(buf, alpha=-group["lr"])


class PerTensorNormalizedSGD(torch.optim.Optimizer):
    """Not elementwise: each tensor's step is its gradient divided by the gradient's norm."""

    def __init__(self, params, lr=0.05):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad / (p.grad.norm() + 1e-12), alpha=-group["lr"])


class NeedsAModel(torch.optim.Optimizer):
    """Cannot be rebuilt from its param groups: its constructor wants something else too."""

    def __init__(self, params, model, lr=0.1):
        self.model = model
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])


def _params():
    return [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))]


def test_probe_tells_elementwise_from_not():
    assert probe_elementwise(MomentumSGD(_params(), weight_decay=0.1)) == ("elementwise", None)
    for opt in (PerTensorNormalizedSGD(_params()), FusedLamb(_params()), torch.optim.Adafactor(_params())):
        verdict, detail = probe_elementwise(opt)
        assert verdict == "differs" and "trained whole and in two pieces differ" in detail, (type(opt), detail)
    verdict, detail = probe_elementwise(NeedsAModel(_params(), model=object()))
    assert verdict == "untested" and "TypeError" in detail


def test_probe_leaves_the_global_rng_alone():
    opt = MomentumSGD(_params())
    state = torch.get_rng_state()
    probe_elementwise(opt)
    assert torch.equal(state, torch.get_rng_state())


def test_probe_uses_every_groups_settings():
    params = _params()

    # the second group's settings make this (elementwise-looking) optimizer normalize per tensor
    class Switch(MomentumSGD):
        @torch.no_grad()
        def step(self, closure=None):
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        g = p.grad / p.grad.norm() if group["momentum"] == 0 else p.grad
                        p.add_(g, alpha=-group["lr"])

    assert probe_elementwise(Switch([{"params": params}]))[0] == "elementwise"
    assert probe_elementwise(Switch([{"params": params[:1]}, {"params": params[1:], "momentum": 0.0}]))[0] == "differs"


def test_check_shardable_trusts_refuses_and_honours_zero_allow_untested_optimizer():
    for opt in (
        torch.optim.AdamW(_params()),
        torch.optim.SGD(_params(), lr=0.1),
        FusedAdam(_params()),
        FusedLion(_params()),
        DeepSpeedCPUAdagrad(_params()),
        torch.optim.RMSprop(_params()),
    ):
        check_shardable(opt, stage=2)
    check_shardable(MomentumSGD(_params()), stage=2)  # probed: elementwise
    with pytest.raises(ValueError, match=r"PerTensorNormalizedSGD is not elementwise.*whole-tensor norms.*stage 0"):
        check_shardable(PerTensorNormalizedSGD(_params()), stage=2)
    for opt, why in (
        (FusedLamb(_params()), "trust ratio"),
        (torch.optim.Adafactor(_params()), "factors"),
        (torch.optim.LBFGS(_params()), "dot products"),
    ):
        with pytest.raises(ValueError, match=why):
            check_shardable(opt, stage=1, allow_untested=True)  # known: the key cannot make it exact
    with pytest.raises(ValueError, match=r"could not be tested.*\"zero_allow_untested_optimizer\": true"):
        check_shardable(NeedsAModel(_params(), model=object()), stage=3)
    with pytest.warns(UserWarning, match="zero_allow_untested_optimizer is set, so it runs anyway"):
        check_shardable(NeedsAModel(_params(), model=object()), stage=3, allow_untested=True)
    with pytest.warns(UserWarning, match="training will differ from one process"):
        check_shardable(PerTensorNormalizedSGD(_params()), stage=2, allow_untested=True)


# =============================================================================== ZeRO on 2 ranks
def _zero_config(stage, **extra):
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**6,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        **extra,
    }


def _reference(make_optimizer, steps, batch):
    model = make_model()
    opt = make_optimizer(model.parameters())
    losses = []
    for x, y in global_batches(steps, batch):
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _engine_train(stage, client, extra, steps):
    dp, rank = dist.get_world_size(), dist.get_rank()
    model = make_model()
    engine, *_ = zerotron.initialize(
        model=model, config=_zero_config(stage, **extra), optimizer=client(model.parameters()) if client else None
    )
    losses = [engine.train_batch(iter(micro_batches(b, rank, dp, 1))).item() for b in global_batches(steps, 2 * dp)]
    return losses, zerotron.zero.consolidated_state_dict(engine.module), type(engine.optimizer).__name__


def _momentum_sgd(params):
    return MomentumSGD(params, lr=0.05, momentum=0.9, weight_decay=0.01)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_trains_a_users_elementwise_optimizer_like_one_process(stage):
    ref_losses, ref_state = _reference(_momentum_sgd, STEPS, 4)
    for losses, state, _ in run_ranks(_engine_train, 2, stage, _momentum_sgd, {}, STEPS):
        assert_losses_close(losses, ref_losses, rtol=1e-5)
        assert max_weight_diff(state, ref_state) < 1e-5


def _normalized(params):
    return PerTensorNormalizedSGD(params)


def _lamb(params):
    return FusedLamb(params, lr=1e-3)


@pytest.mark.parametrize(
    "stage,client,message",
    [
        (2, _normalized, r"PerTensorNormalizedSGD is not elementwise.*whole-tensor norms.*zero_optimization.stage 0"),
        (1, _lamb, r"FusedLamb is not elementwise: its trust ratio"),
    ],
)
def test_zero_refuses_a_non_elementwise_optimizer(stage, client, message):
    with pytest.raises(RankError, match=message):
        run_ranks(_engine_train, 2, stage, client, {}, 1)


def _needs_a_model(params):
    return NeedsAModel(params, model=None, lr=0.05)


def test_zero_refuses_an_optimizer_it_cannot_test_unless_told():
    with pytest.raises(RankError, match=r"NeedsAModel.*could not be tested.*\"zero_allow_untested_optimizer\": true"):
        run_ranks(_engine_train, 2, 2, _needs_a_model, {}, 1)


def test_zero_allow_untested_optimizer_lets_it_run():
    ref_losses, ref_state = _reference(lambda ps: torch.optim.SGD(ps, lr=0.05), STEPS, 4)
    for losses, state, _ in run_ranks(
        _engine_train, 2, 2, _needs_a_model, {"zero_allow_untested_optimizer": True}, STEPS
    ):
        assert_losses_close(losses, ref_losses, rtol=1e-5)
        assert max_weight_diff(state, ref_state) < 1e-5


LAMB = {"type": "Lamb", "params": {"lr": 1e-3, "weight_decay": 0.01, "max_coeff": 10.0, "min_coeff": 0.01}}


def test_lamb_from_the_config_at_stage_0_trains_like_one_process():
    ref_losses, ref_state = _reference(lambda ps: FusedLamb(ps, lr=1e-3, weight_decay=0.01), STEPS, 4)
    for losses, state, name in run_ranks(_engine_train, 2, 0, None, {"optimizer": LAMB}, STEPS):
        assert name == "FusedLamb"
        assert_losses_close(losses, ref_losses, rtol=1e-5)
        assert max_weight_diff(state, ref_state) < 1e-5


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_lamb_from_the_config_under_zero_is_refused_before_anything_starts(stage):
    with pytest.raises(ConfigError) as info:
        Config.load({**_zero_config(stage), "optimizer": LAMB}, world_size=2)
    assert info.value.key == "optimizer.type" and info.value.value == "Lamb"
    assert "not elementwise" in str(info.value) and "use zero_optimization.stage 0" in str(info.value)


ADAM_NO_CORRECTION = {
    "type": "Adam",
    "params": {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-6, "weight_decay": 0.1, "bias_correction": False},
}


@pytest.mark.parametrize("stage", [0, 2])
def test_adam_without_bias_correction_from_the_config_trains_like_one_process(stage):
    def make(ps):
        return FusedAdam(ps, lr=1e-3, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1, bias_correction=False)

    ref_losses, ref_state = _reference(make, STEPS, 4)
    corrected_losses, _ = _reference(
        lambda ps: torch.optim.AdamW(ps, lr=1e-3, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1), STEPS, 4
    )
    assert abs(corrected_losses[-1] - ref_losses[-1]) > 1e-4  # the comparison can tell them apart
    for losses, state, name in run_ranks(_engine_train, 2, stage, None, {"optimizer": ADAM_NO_CORRECTION}, STEPS):
        assert name == "FusedAdam"
        assert_losses_close(losses, ref_losses, rtol=1e-5)
        assert max_weight_diff(state, ref_state) < 1e-5


# =============================================================================== config: optimizers
def _load(extra, world_size=1):
    return Config.load({"train_micro_batch_size_per_gpu": 1, **extra}, world_size=world_size)


def _p():
    return [torch.nn.Parameter(torch.zeros(3))]


def test_bias_correction_both_values_and_how_adam_is_built():
    for value in (True, False):
        cfg = _load({"optimizer": {"type": "Adam", "params": {"lr": 1e-3, "bias_correction": value}}})
        assert cfg.optimizer.params["bias_correction"] is value
    opt = build_optimizer("Adam", {"lr": 1e-3, "bias_correction": False}, _p())
    assert type(opt) is FusedAdam and opt.adam_w_mode and opt.param_groups[0]["bias_correction"] is False
    opt = build_optimizer("Adam", {"lr": 1e-3, "bias_correction": False, "adam_w_mode": False}, _p())
    assert type(opt) is FusedAdam and not opt.adam_w_mode
    assert type(build_optimizer("AdamW", {"bias_correction": False}, _p(), on_host=True)) is FusedAdam
    assert type(build_optimizer("AdamW", {"bias_correction": True}, _p(), on_host=True)) is CPUAdam
    assert type(build_optimizer("AdamW", {"bias_correction": True}, _p())) is torch.optim.AdamW
    opt = build_optimizer("Adam", {"lr": 1e-3, "set_grad_none": True, "fp32_optimizer_states": True}, _p())
    assert type(opt) is torch.optim.AdamW


@pytest.mark.parametrize(
    "type_name,on_host,cls",
    [
        ("Lion", False, FusedLion),
        ("LION", True, DeepSpeedCPULion),
        ("lamb", False, FusedLamb),
        ("Adagrad", False, torch.optim.Adagrad),
        ("adagrad", True, DeepSpeedCPUAdagrad),
        ("RMSprop", False, torch.optim.RMSprop),
        ("adamax", False, torch.optim.Adamax),
        ("NAdam", False, torch.optim.NAdam),
        ("sgd", False, torch.optim.SGD),
    ],
)
def test_deepspeed_and_torch_optimizer_names(type_name, on_host, cls):
    assert type(build_optimizer(type_name, {"lr": 1e-3}, _p(), on_host=on_host)) is cls


def test_optimizer_parameters_are_checked_against_what_gets_built():
    with pytest.raises(ConfigError, match=r"optimizer.params.lr_decay.*with optimizer offload"):
        build_optimizer("Adagrad", {"lr_decay": 0.1}, _p(), on_host=True)
    build_optimizer("Adagrad", {"lr_decay": 0.1}, _p())  # torch's Adagrad has it
    with pytest.raises(ConfigError, match=r"optimizer.params.eps.*unknown parameter for Lion"):
        build_optimizer("Lion", {"eps": 1e-8}, _p())
    with pytest.raises(ConfigError, match=r"optimizer.params.alpha.*unknown parameter for NAdam"):
        build_optimizer("NAdam", {"alpha": 0.9}, _p())
    opt = build_optimizer("Lamb", {"lr": 2e-3, "max_coeff": 5.0, "min_coeff": 0.1, "bias_correction": False}, _p())
    assert opt.param_groups[0]["max_coeff"] == 5.0 and opt.param_groups[0]["bias_correction"] is False


@pytest.mark.parametrize(
    "type_name,what", [("OneBitAdam", "1-bit Adam"), ("onebitlamb", "1-bit LAMB"), ("ZeroOneAdam", "0/1 Adam")]
)
def test_one_bit_optimizers_are_refused_with_the_fix(type_name, what):
    with pytest.raises(ConfigError) as info:
        _load({"optimizer": {"type": type_name, "params": {"lr": 1e-3, "freeze_step": 100}}})
    assert (info.value.key, info.value.value) == ("optimizer.type", type_name)
    assert what in str(info.value) and "use 'Adam' or 'Lamb'" in str(info.value)


@pytest.mark.parametrize(
    "type_name,why",
    [
        ("Muon", "orthogonalizes whole matrices"),
        ("LBFGS", "closure"),
        ("SparseAdam", "sparse gradients"),
        ("Shampoo", "torch.optim"),
    ],
)
def test_optimizers_zerotron_cannot_build_are_refused_with_the_reason(type_name, why):
    with pytest.raises(ConfigError, match=why):
        _load({"optimizer": {"type": type_name}})


def test_mup_optimizers_come_from_mup(monkeypatch):
    import sys
    import types

    monkeypatch.delitem(sys.modules, "mup", raising=False)
    monkeypatch.setattr("builtins.__import__", _no_mup(__import__))
    with pytest.raises(ConfigError, match="pip install mup"):
        _load({"optimizer": {"type": "MuAdamW", "params": {"lr": 1e-3}}})
    monkeypatch.undo()
    calls = []
    stub = types.ModuleType("mup")
    stub.MuAdamW = lambda params, **kw: calls.append(kw) or torch.optim.AdamW(params, **kw)
    monkeypatch.setitem(sys.modules, "mup", stub)
    opt = build_optimizer("muadamw", {"lr": 2e-3, "weight_decay": 0.1}, _p())
    assert type(opt) is torch.optim.AdamW and calls == [{"lr": 2e-3, "weight_decay": 0.1}]


def _no_mup(real_import):
    def fake(name, *args, **kwargs):
        if name == "mup":
            raise ImportError("No module named 'mup'")
        return real_import(name, *args, **kwargs)

    return fake


def test_fp32_optimizer_states_false_warns():
    with pytest.warns(UserWarning, match="fp32_optimizer_states = false: zerotron keeps optimizer moments in fp32"):
        _load({"optimizer": {"type": "Adam", "params": {"fp32_optimizer_states": False}}})


# =============================================================================== config: other keys
def test_offload_param_below_stage_3_is_ignored_with_a_warning_naming_it():
    for stage in (0, 1, 2):
        with pytest.warns(
            UserWarning,
            match=rf"zero_optimization.offload_param is ignored at zero_optimization.stage "
            rf"{stage}",
        ):
            _load({"zero_optimization": {"stage": stage, "offload_param": {"device": "cpu", "pin_memory": True}}})
    with pytest.warns(UserWarning, match="offload_param is ignored"):  # NVMe too: it is not used anyway
        _load({"zero_optimization": {"stage": 2, "offload_param": {"device": "nvme", "nvme_path": "/x"}}})
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        cfg = _load({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}})
    assert cfg.zero_optimization.offload_param.device == "cpu" and "offload_param" not in _messages(record)


def test_features_zerotron_lacks_are_warned_about_by_name():
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        _load(
            {
                "compression_training": {"weight_quantization": {}},
                "autotuning": {"enabled": True},
                "zero_optimization": {"stage": 2, "zenflow": {"topk_ratio": 0.1}},
                "bf16": {"enabled": True, "bf16_master_weights_and_grads": True},
                "torch_autocast": {"enabled": True, "dtype": "torch.bfloat16"},
                "progressive_layer_drop": {"enabled": False},
            }
        )
    text = _messages(record)
    assert "zerotron does not implement these DeepSpeed features and ignores their keys" in text
    for name in (
        "compression_training",
        "autotuning",
        "zero_optimization.zenflow",
        "bf16.bf16_master_weights_and_grads",
        "torch_autocast",
    ):
        assert name in text, name
    assert "unknown config keys" not in text and "progressive_layer_drop" not in text


@pytest.mark.parametrize(
    "extra,key",
    [
        ({"progressive_layer_drop": {"enabled": True, "theta": 0.5}}, "progressive_layer_drop.enabled"),
        ({"curriculum_learning": {"enabled": True}}, "curriculum_learning.enabled"),
        ({"elasticity": {"enabled": True, "max_train_batch_size": 64}}, "elasticity.enabled"),
        ({"sequence_parallel_size": 2}, "sequence_parallel_size"),
        ({"gradient_allreduce_op": "sum"}, "gradient_allreduce_op"),
        ({"managed_gradient_accumulation": False}, "managed_gradient_accumulation"),
    ],
)
def test_features_whose_absence_changes_the_math_are_refused(extra, key):
    with pytest.raises(ConfigError) as info:
        _load(extra)
    assert info.value.key == key and "zerotron" in info.value.fix


def test_deprecated_and_alias_zero_keys_are_read():
    with pytest.warns(UserWarning, match="zero_optimization.cpu_offload is deprecated"):
        cfg = _load({"zero_optimization": {"stage": 2, "cpu_offload": True, "cpu_offload_use_pin_memory": True}})
    off = cfg.zero_optimization.offload_optimizer
    assert off.device == "cpu" and off.pin_memory
    cfg = _load(
        {
            "zero_optimization": {
                "stage": 3,
                "prefetch_bucket_size": 123,
                "param_persistence_threshold": 7,
                "max_live_parameters": 99,
                "gather_16bit_weights_on_model_save": True,
            }
        }
    )
    z = cfg.zero_optimization
    assert (
        z.stage3_prefetch_bucket_size,
        z.stage3_param_persistence_threshold,
        z.stage3_max_live_parameters,
        z.stage3_gather_16bit_weights_on_model_save,
    ) == (123, 7, 99, True)
    with pytest.raises(ConfigError, match="another name for stage3_prefetch_bucket_size"):
        _load({"zero_optimization": {"stage": 3, "prefetch_bucket_size": 1, "stage3_prefetch_bucket_size": 2}})


def test_auto_inside_deepspeeds_model_sections_means_the_default():
    cfg = _load(
        {
            "zero_optimization": {
                "stage": 3,
                "stage3_max_live_parameters": "auto",
                "sub_group_size": "auto",
                "offload_param": {"device": "cpu", "buffer_size": "auto"},
            },
            "fp16": {"enabled": True, "loss_scale_window": "auto"},
        }
    )
    assert cfg.zero_optimization.stage3_max_live_parameters == 1_000_000_000
    assert cfg.zero_optimization.offload_param.buffer_size == 100_000_000 and cfg.fp16.loss_scale_window == 1000
    with pytest.raises(ConfigError, match="cannot resolve 'auto'"):
        _load({"steps_per_print": "auto"})


def test_zero_allow_untested_optimizer_is_a_setting():
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        cfg = _load({"zero_allow_untested_optimizer": True})
    assert cfg.zero_allow_untested_optimizer is True and _messages(record) == ""
    assert _load({}).zero_allow_untested_optimizer is False


# =============================================================================== the survey script
def test_config_survey_counts_and_reasons(tmp_path, capsys):
    from tools.config_survey import main

    configs = {
        "clean.json": {
            "train_batch_size": 8,
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 2,
            "optimizer": {"type": "Lamb", "params": {"lr": 1e-3, "bias_correction": False}},
        },
        "warn.json": {"train_micro_batch_size_per_gpu": "auto", "autotuning": {"enabled": True}},
        "onebit.json": {"train_batch_size": 4, "optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3}}},
        "not_ds.json": {"vocab_size": 10},
    }
    for name, raw in configs.items():
        (tmp_path / name).write_text(json.dumps(raw))
    (tmp_path / "template.json").write_text('{"train_batch_size": GB_SIZE}')
    rows = main([str(tmp_path)])
    out = capsys.readouterr().out
    by_file = {r["file"].split("/")[-1]: r for r in rows}
    assert set(by_file) == {"clean.json", "warn.json", "onebit.json"}
    assert by_file["clean.json"]["outcome"] == "load" and by_file["clean.json"]["world_size"] == 2
    assert by_file["warn.json"]["outcome"] == "warn" and by_file["warn.json"]["warnings"] == [
        "not implemented: autotuning"
    ]
    assert by_file["onebit.json"]["outcome"] == "refused" and "optimizer.type" in by_file["onebit.json"]["reason"]
    assert "load: 1   load with warnings: 1   refused: 1" in out and "not JSON (templates): 1" in out
