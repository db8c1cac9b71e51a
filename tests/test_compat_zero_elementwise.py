"""ZeRO's elementwise check: the probe that tells an elementwise optimizer from one that is not, the
trusted classes, zero_allow_untested_optimizer, and ZeRO on 2 ranks training a user's optimizer (or
refusing it) against one process."""

import pytest
import torch
import torch.distributed as dist
from distributed import RankError, run_ranks
from parity import assert_losses_close, global_batches, make_model, max_weight_diff, micro_batches

import zerotron
from zerotron import Config, ConfigError
from zerotron.ops.adagrad import DeepSpeedCPUAdagrad
from zerotron.ops.adam import FusedAdam
from zerotron.ops.lamb import FusedLamb
from zerotron.ops.lion import FusedLion
from zerotron.optim import check_shardable, probe_elementwise

STEPS = 3


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
