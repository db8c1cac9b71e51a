"""fp16 loss scaling, master-weight gradients and global-norm clipping.

The dynamic scaler's trajectories below are written out by hand from DeepSpeed's rules
(deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler), not recomputed with the same algorithm:

* the initial scale is 2**initial_scale_power;
* an overflow when the hysteresis left is <= 1 halves the scale (never below min_loss_scale);
  otherwise it only decrements the hysteresis left;
* after an overflow at iteration j, the scale doubles at iteration j + 1 + window (and at every
  further multiple of the window); with no overflow yet, first at iteration == window;
  a doubling refills the hysteresis;
* consecutive_hysteresis refills the hysteresis after every clean step.

Patterns: one character per update, "X" = overflow, "." = clean step.
"""

import json

import pytest
import torch

from zerotron.config import FP16Config
from zerotron.precision import LossScaleAtMinimum, LossScaler, MasterWeights, clip_by_global_norm


def fp16(power, window, hysteresis, consecutive=False, min_scale=1.0):
    return FP16Config(
        enabled=True,
        loss_scale=0,
        initial_scale_power=power,
        loss_scale_window=window,
        hysteresis=hysteresis,
        consecutive_hysteresis=consecutive,
        min_loss_scale=min_scale,
    )


def run(scaler, pattern):
    """Feed `pattern` to the scaler; the scale and hysteresis left after each update."""
    scales, hysteresis = [], []
    for c in pattern:
        assert c in "X."
        scaler.update(c == "X")
        scales.append(scaler.scale)
        hysteresis.append(scaler.hysteresis_left)
    return scales, hysteresis


# (id, config, pattern, scale after each update, hysteresis left after each update) - by hand.
CASES = [
    (
        "clean-window2-hyst1",
        fp16(power=4, window=2, hysteresis=1),
        ".......",
        [16, 16, 32, 32, 64, 64, 128],
        [1, 1, 1, 1, 1, 1, 1],
    ),
    (
        "clean-window3-hyst2",
        fp16(power=2, window=3, hysteresis=2),
        "..........",
        [4, 4, 4, 8, 8, 8, 16, 16, 16, 32],
        [2, 2, 2, 2, 2, 2, 2, 2, 2, 2],
    ),
    (
        "one-overflow-window3-hyst1",
        fp16(power=4, window=3, hysteresis=1),
        "..X.......",
        [16, 16, 8, 8, 8, 8, 16, 16, 16, 32],
        [1, 1, 1, 1, 1, 1, 1, 1, 1, 1],
    ),
    (
        "repeated-window2-hyst1",
        fp16(power=4, window=2, hysteresis=1),
        "X.X..X....",
        [8, 8, 4, 4, 4, 2, 2, 2, 4, 4],
        [1, 1, 1, 1, 1, 1, 1, 1, 1, 1],
    ),
    # an overflow exactly where the doubling was due halves instead, and restarts the count
    (
        "overflow-at-doubling-window2-hyst1",
        fp16(power=4, window=2, hysteresis=1),
        "X..X...",
        [8, 8, 8, 4, 4, 4, 8],
        [1, 1, 1, 1, 1, 1, 1],
    ),
    (
        "burst-window2-hyst2",
        fp16(power=4, window=2, hysteresis=2),
        "XXX....XX",
        [16, 8, 4, 4, 4, 8, 8, 8, 4],
        [1, 1, 1, 1, 1, 2, 2, 1, 1],
    ),
    (
        "scattered-window2-hyst2",
        fp16(power=4, window=2, hysteresis=2),
        "XX.X.XX...",
        [16, 8, 8, 4, 4, 2, 1, 1, 1, 2],
        [1, 1, 1, 1, 1, 1, 1, 1, 1, 2],
    ),
    (
        "scattered-window2-hyst2-consecutive",
        fp16(power=4, window=2, hysteresis=2, consecutive=True),
        "XX.X.XX...",
        [16, 8, 8, 8, 8, 8, 4, 4, 4, 8],
        [1, 1, 2, 1, 2, 1, 1, 2, 2, 2],
    ),
    (
        "window3-hyst3",
        fp16(power=5, window=3, hysteresis=3),
        "X.X.XX....X",
        [32, 32, 32, 32, 16, 8, 8, 8, 8, 16, 16],
        [2, 2, 1, 1, 1, 1, 1, 1, 1, 3, 2],
    ),
    (
        "window3-hyst3-consecutive",
        fp16(power=5, window=3, hysteresis=3, consecutive=True),
        "XX.XXX....",
        [32, 32, 32, 32, 32, 16, 16, 16, 16, 32],
        [2, 1, 3, 2, 1, 1, 3, 3, 3, 3],
    ),
    # the floor: 8 -> 4 -> max(2, 3) = 3, then doubling from the floor, then back to it
    (
        "min-floor-window2",
        fp16(power=3, window=2, hysteresis=1, min_scale=3.0),
        "XX...X",
        [4, 3, 3, 3, 6, 3],
        [1, 1, 1, 1, 1, 1],
    ),
]

# (id, config, pattern whose last overflow raises LossScaleAtMinimum, scales before that)
AT_MINIMUM = [
    ("halved-to-min", fp16(power=3, window=100, hysteresis=1, min_scale=2.0), "XXX", [4, 2]),
    ("floored-to-min", fp16(power=3, window=2, hysteresis=1, min_scale=3.0), "XX...XX", [4, 3, 3, 3, 6, 3]),
    # at the minimum, hysteresis is still spent first
    ("hysteresis-at-min", fp16(power=1, window=100, hysteresis=2, min_scale=2.0), "XX", [2]),
    (
        "hysteresis-at-min-consecutive",
        fp16(power=1, window=100, hysteresis=2, consecutive=True, min_scale=2.0),
        "X.X.XX",
        [2, 2, 2, 2, 2],
    ),
]


@pytest.mark.parametrize("name,cfg,pattern,scales,hysteresis", CASES, ids=[c[0] for c in CASES])
def test_dynamic_scale_trajectory(name, cfg, pattern, scales, hysteresis):
    assert len(pattern) == len(scales) == len(hysteresis)
    scaler = LossScaler(cfg)
    assert scaler.dynamic and scaler.enabled
    assert scaler.scale == 2**cfg.initial_scale_power
    got_scales, got_hysteresis = run(scaler, pattern)
    assert got_scales == scales
    assert got_hysteresis == hysteresis
    assert scaler.iteration == len(pattern)
    assert scaler.last_overflow == (pattern.rindex("X") if "X" in pattern else -1)


@pytest.mark.parametrize("name,cfg,pattern,scales", AT_MINIMUM, ids=[c[0] for c in AT_MINIMUM])
def test_overflow_at_minimum_scale_raises(name, cfg, pattern, scales):
    scaler = LossScaler(cfg)
    got, _ = run(scaler, pattern[:-1])
    assert got == scales
    assert scaler.scale == cfg.min_loss_scale
    with pytest.raises(LossScaleAtMinimum) as info:
        scaler.update(True)
    message = str(info.value)
    assert f"minimum loss scale {cfg.min_loss_scale:g}" in message
    assert f"step {len(pattern) - 1}" in message
    for fix in ("lower the learning rate", "fp16.min_loss_scale", "bf16"):
        assert fix in message


def test_at_minimum_is_a_runtime_error():
    assert issubclass(LossScaleAtMinimum, RuntimeError)


def test_default_config_doubles_first_at_iteration_1000():
    scaler = LossScaler(FP16Config(enabled=True))
    assert scaler.scale == 65536.0
    for _ in range(1000):  # iterations 0 .. 999
        scaler.update(False)
    assert scaler.scale == 65536.0
    scaler.update(False)  # iteration 1000 == window
    assert scaler.scale == 131072.0
    # default hysteresis 2: the first overflow only spends hysteresis
    scaler.update(True)
    assert (scaler.scale, scaler.hysteresis_left) == (131072.0, 1)
    scaler.update(True)
    assert (scaler.scale, scaler.hysteresis_left) == (65536.0, 1)


def test_doubling_is_window_plus_one_after_an_overflow():
    # overflow at iteration 4, window 5: doubles at iteration 4 + 1 + 5 = 10, then 15
    scaler = LossScaler(fp16(power=6, window=5, hysteresis=1))
    scales, _ = run(scaler, "....X" + "." * 11)
    #                iter: 0   1   2   3   4   5   6   7   8   9   10   11   12   13   14   15
    assert scales == [64, 64, 64, 64, 32, 32, 32, 32, 32, 32, 64, 64, 64, 64, 64, 128]


@pytest.mark.parametrize(
    "cfg",
    [
        FP16Config(enabled=True, loss_scale=128.0, loss_scale_window=1, hysteresis=1),
        FP16Config(enabled=True, loss_scale=0.5, min_loss_scale=1.0, loss_scale_window=1, hysteresis=1),
    ],
)
def test_static_scale_never_changes(cfg):
    scaler = LossScaler(cfg)
    assert scaler.enabled and not scaler.dynamic
    scales, _ = run(scaler, "XX.X....XXXX....")
    assert scales == [cfg.loss_scale] * 16
    assert scaler.iteration == 16


@pytest.mark.parametrize("cfg", [None, FP16Config(enabled=False), FP16Config(enabled=False, loss_scale=64.0)])
def test_disabled_scaler_is_one(cfg):
    scaler = LossScaler(cfg)
    assert not scaler.enabled and not scaler.dynamic
    scales, _ = run(scaler, "X..X.XXX")
    assert scales == [1.0] * 8


def test_state_dict_round_trip():
    cfg = fp16(power=5, window=3, hysteresis=3)
    # CASES "window3-hyst3": pattern X.X.XX....X, scales 32 32 32 32 16 8 8 8 8 16 16
    first, rest = "X.X.XX", "....X"
    a = LossScaler(cfg)
    run(a, first)
    state = json.loads(json.dumps(a.state_dict()))  # plain numbers: survives a JSON/pickle checkpoint
    assert state == {"scale": 8.0, "hysteresis_left": 1, "iteration": 6, "last_overflow": 5}

    b = LossScaler(cfg)
    b.load_state_dict(state)
    assert b.state_dict() == a.state_dict()
    scales_a, hyst_a = run(a, rest)
    scales_b, hyst_b = run(b, rest)
    assert scales_b == scales_a == [8, 8, 8, 16, 16]
    assert hyst_b == hyst_a == [1, 1, 1, 3, 2]
    assert (
        b.state_dict() == a.state_dict() == {"scale": 16.0, "hysteresis_left": 2, "iteration": 11, "last_overflow": 10}
    )
    # without the state, the same steps give a different trajectory
    fresh = LossScaler(cfg)
    assert run(fresh, rest)[0] != scales_b


def test_state_dict_is_a_snapshot():
    scaler = LossScaler(fp16(power=4, window=2, hysteresis=1))
    state = scaler.state_dict()
    run(scaler, "X...")
    assert state == {"scale": 16.0, "hysteresis_left": 1, "iteration": 0, "last_overflow": -1}


# =============================================================================== clipping
def _grads(seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(7, 5), (5,), (3, 4, 2), (1,)]
    return [torch.randn(s, generator=g) * scale for s in shapes]


def _torch_clip(grads, max_norm):
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    return [p.grad for p in params], norm


@pytest.mark.parametrize("max_norm,scale", [(1.0, 1.0), (0.25, 3.0), (0.001, 1.0), (1e3, 1.0), (2.0, 1e-3)])
def test_clip_matches_torch(max_norm, scale):
    grads = _grads(scale=scale)
    expected, expected_norm = _torch_clip(grads, max_norm)
    original_norm = torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads]))
    norm = clip_by_global_norm(grads, max_norm)
    torch.testing.assert_close(norm, expected_norm, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(norm, original_norm, rtol=1e-6, atol=1e-6)  # the pre-clip norm
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    clipped_norm = torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads]))
    assert clipped_norm <= max_norm * (1 + 1e-5)
    if original_norm > max_norm:
        assert clipped_norm == pytest.approx(max_norm, rel=1e-5)


def test_clip_in_place_and_no_op_below_max_norm():
    grads = _grads(seed=1)
    before = [g.clone() for g in grads]
    ids = [id(g) for g in grads]
    norm = clip_by_global_norm(grads, 1e6)
    assert [id(g) for g in grads] == ids
    for g, b in zip(grads, before):
        torch.testing.assert_close(g, b, rtol=0, atol=1e-6)
    assert norm.item() > 1.0


def test_clip_scales_in_place():
    grads = [torch.tensor([3.0, 0.0]), torch.tensor([4.0])]  # norm 5
    norm = clip_by_global_norm(grads, 1.0)
    assert norm.item() == pytest.approx(5.0)
    torch.testing.assert_close(grads[0], torch.tensor([0.6, 0.0]), rtol=0, atol=1e-6)
    torch.testing.assert_close(grads[1], torch.tensor([0.8]), rtol=0, atol=1e-6)


def test_clip_max_norm_zero_does_not_clip():
    grads = _grads(seed=2, scale=10.0)
    before = [g.clone() for g in grads]
    norm = clip_by_global_norm(grads, 0.0)
    for g, b in zip(grads, before):
        assert torch.equal(g, b)
    expected = torch.linalg.vector_norm(torch.cat([b.flatten() for b in before]))
    torch.testing.assert_close(norm, expected, rtol=1e-6, atol=1e-6)
    assert norm.item() > 10.0


def test_clip_empty():
    assert clip_by_global_norm([], 1.0).item() == 0.0


# =============================================================================== master weights
def _fp16_params(grad_values):
    params = [torch.nn.Parameter(torch.zeros(len(v), dtype=torch.float16)) for v in grad_values]
    for p, v in zip(params, grad_values):
        p.grad = torch.tensor(v, dtype=torch.float16)
    return params


def test_take_grads_unscales_finite_fp16_grads_into_fp32_masters():
    params = _fp16_params([[1024.0, -2048.0, 3.0], [0.1, 512.5]])
    mw = MasterWeights(params)
    assert mw.separate
    assert all(m.dtype == torch.float32 for m in mw.masters)
    assert not mw.take_grads(1 / 1024)
    grads = mw.grads()
    assert all(g.dtype == torch.float32 for g in grads)
    # values by hand: fp16(0.1) = 0.0999755859375 and fp16(512.5) = 512.5; /1024 is exact in fp32
    assert torch.equal(grads[0], torch.tensor([1.0, -2.0, 3.0 / 1024]))
    assert torch.equal(grads[1], torch.tensor([0.0999755859375 / 1024, 512.5 / 1024]))
    # the model's fp16 grads are left alone
    assert torch.equal(params[0].grad, torch.tensor([1024.0, -2048.0, 3.0], dtype=torch.float16))


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
def test_take_grads_reports_non_finite_fp16_grads(bad):
    params = _fp16_params([[1.0, 2.0], [3.0, bad, 4.0]])
    mw = MasterWeights(params)
    assert mw.take_grads(1 / 8)
    # next step's finite grads are not reported as overflow (the flag does not stick)
    params[1].grad = torch.tensor([3.0, 5.0, 4.0], dtype=torch.float16)
    assert not mw.take_grads(1 / 8)
    assert torch.equal(mw.grads()[1], torch.tensor([0.375, 0.625, 0.5]))


def test_take_grads_fp16_overflowing_the_dtype_is_reported():
    # 70000 does not fit in fp16: the model grad is inf
    params = _fp16_params([[70000.0, 1.0]])
    assert torch.isinf(params[0].grad[0])
    assert MasterWeights(params).take_grads(1 / 65536)


def test_take_grads_without_scale_copies_only():
    params = _fp16_params([[2.0, float("inf")]])
    mw = MasterWeights(params)
    assert not mw.take_grads(None)
    assert torch.equal(mw.grads()[0], torch.tensor([2.0, float("inf")]))


def test_fp32_params_are_their_own_masters():
    params = [torch.nn.Parameter(torch.zeros(2))]
    params[0].grad = torch.tensor([4.0, 8.0])
    mw = MasterWeights(params)
    assert not mw.separate and mw.masters is params
    assert not mw.take_grads(0.25)
    assert torch.equal(params[0].grad, torch.tensor([1.0, 2.0]))  # unscaled in place
