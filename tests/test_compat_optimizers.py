"""DeepSpeed's optimizers (zerotron.ops: FusedAdam and CPUAdam, Lion, Adagrad, Lamb) against reference
updates written out element by element, and torch's own where they are the same."""

import math

import pytest
import torch

from zerotron.ops.adagrad import DeepSpeedCPUAdagrad
from zerotron.ops.adam import CPUAdam, DeepSpeedCPUAdam, FusedAdam
from zerotron.ops.lamb import FusedLamb
from zerotron.ops.lion import DeepSpeedCPULion, FusedLion


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
