"""What DeepSpeed's own unit tests expect of the last calls found hanging or missing through the alias
(tools/deepspeed_unit_tests.py): the refusals DeepSpeed makes (ignore_unused_parameters false with an unused
parameter, zero_force_ds_cpu_optimizer with a client optimizer under offload, a direct loss.backward() at ZeRO-0),
each an exception that survives a pool worker's pickling; and the names built for them (set_dataiterator,
unwrap_model_for_generation, DeepSpeedZeroConfig's deprecated keys and offload sections, 0/1 for true/false,
DeepSpeedTransformerLayer refused by name)."""

import pickle

import pytest
import torch
import torch.nn as nn
from distributed import RankError, run_ranks

import zerotron
from zerotron.errors import ConfigError, MisuseError


class _Unused(nn.Module):
    def __init__(self):
        super().__init__()
        self.used, self.unused = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.used(x).pow(2).mean()


def _config(stage, **zero):
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage, **zero},
    }


# ---- ignore_unused_parameters: false ------------------------------------------------------------------------
def _train_unused(stage, ignore):
    torch.manual_seed(0)
    engine, *_ = zerotron.initialize(model=_Unused(), config=_config(stage, ignore_unused_parameters=ignore))
    for _ in range(4):
        engine.backward(engine(torch.randn(1, 4)))
        engine.step()
    return engine.global_steps


@pytest.mark.parametrize("stage", [1, 2])
def test_ignore_unused_parameters_false_refuses_the_step_naming_the_parameter(stage):
    with pytest.raises(RankError, match=r"MisuseError.*not used in producing the loss.*unused\.weight, unused\.bias"):
        run_ranks(_train_unused, 1, stage, False)
    assert run_ranks(_train_unused, 1, stage, True) == [2]  # the default trains on


def test_ignore_unused_parameters_false_is_named_where_it_is_not_checked():
    with pytest.warns(UserWarning, match="checked at stages 1 and 2 only"):
        zerotron.Config.load(_config(3, ignore_unused_parameters=False))


def test_misuse_error_is_an_assertion_and_survives_pickling():
    e = pickle.loads(pickle.dumps(MisuseError("x")))
    assert isinstance(e, AssertionError) and isinstance(e, RuntimeError) and str(e) == "x"


# ---- zero_force_ds_cpu_optimizer ----------------------------------------------------------------------------
def _client_under_offload(force, cpu_adam):
    from zerotron.ops.adam import DeepSpeedCPUAdam

    model = _Unused()
    cfg = _config(1, offload_optimizer={"device": "cpu"})
    del cfg["optimizer"]
    if force is not None:
        cfg["zero_force_ds_cpu_optimizer"] = force
    opt = (DeepSpeedCPUAdam if cpu_adam else torch.optim.Adam)(model.parameters(), lr=1e-2)
    try:
        zerotron.initialize(model=model, optimizer=opt, config=cfg)
    except ConfigError as e:
        return e.key
    return "ran"


def _offload_cases(cases):
    return [_client_under_offload(force, cpu_adam) for force, cpu_adam in cases]


def test_zero_force_ds_cpu_optimizer_refuses_a_client_optimizer_under_offload():
    from zerotron.compat.runtime.zero.utils import ZeRORuntimeException

    assert issubclass(ConfigError, ZeRORuntimeException)  # what DeepSpeed's test catches
    cases = [(True, False), (1, False), (True, True), (False, False), (None, False)]
    key = "zero_force_ds_cpu_optimizer"
    assert run_ranks(_offload_cases, 1, cases) == [[key, key, "ran", "ran", "ran"]]


# ---- loss.backward() at ZeRO-0 --------------------------------------------------------------------------------
def _direct_backward():
    engine, *_ = zerotron.initialize(model=_Unused(), config=_config(0))
    engine(torch.randn(1, 4)).backward()
    # torch.func transforms backpropagate through the engine's output on their own: no training backward
    grads = torch.func.grad(lambda p: torch.func.functional_call(engine.module, p, (torch.randn(1, 4),)))(
        {k: v.detach() for k, v in engine.module.named_parameters()}
    )
    return sorted(grads)


def test_direct_backward_trains_at_zero_0_where_deepspeed_refuses_it_and_torch_func_passes():
    # DeepSpeed 0.19.8 refuses loss.backward() at stage 0 (its engine sees a direct backward only through its
    # ZeRO optimizers); zerotron reduces it at every stage (parity: test_user_calls.py)
    assert run_ranks(_direct_backward, 1) == [["unused.bias", "unused.weight", "used.bias", "used.weight"]]


# ---- set_dataiterator, unwrap_model_for_generation -----------------------------------------------------------
def _pipeline_with_iterator():
    from zerotron.compat.runtime.dataloader import RepeatingLoader
    from zerotron.pipe import PipelineModule

    layers = [nn.Linear(1, 1, bias=False), nn.Linear(1, 1, bias=False)]
    for layer in layers:
        layer.weight.data.fill_(1.0)
    cfg = {
        "train_batch_size": 1,
        "train_micro_batch_size_per_gpu": 1,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
    }
    model = PipelineModule(layers=layers, num_stages=2, loss_fn=nn.MSELoss())
    engine, *_ = zerotron.initialize(model=model, config=cfg)
    engine.set_dataiterator(RepeatingLoader([(torch.ones(1, 1), torch.zeros(1, 1))]))
    engine.train_batch()
    return next(engine.module.parameters()).item()


def test_pipeline_set_dataiterator_feeds_train_batch():
    # d/dw (w1*w2*1 - 0)^2 at w = 1: 2; SGD lr 0.1: 1 - 0.2 (DeepSpeed's test_pipe expectation)
    assert run_ranks(_pipeline_with_iterator, 2) == [pytest.approx(0.8), pytest.approx(0.8)]


def _generate_unwrapped():
    engine, *_ = zerotron.initialize(
        model=_Unused(), config=_config(3, stage3_param_persistence_threshold=0, ignore_unused_parameters=True)
    )
    from zerotron.compat.runtime.zero import unwrap_model_for_generation

    outside = engine.module.used.weight.numel()
    with unwrap_model_for_generation(engine) as unwrapped:
        inside = engine.module.used.weight.shape
        assert unwrapped is engine
        engine(torch.randn(1, 4))
    engine.backward(engine(torch.randn(1, 4)))
    engine.step()
    return outside, tuple(inside), engine.module.used.weight.numel()


def test_unwrap_model_for_generation_gathers_and_training_goes_on():
    for outside, inside, after in run_ranks(_generate_unwrapped, 2):
        assert inside == (4, 4) and outside == after == 0  # partitioned outside the block


# ---- config: deprecated keys, 0 and 1 ------------------------------------------------------------------------
def test_deepspeed_zero_config_deprecated_fields_and_offload_sections():
    from zerotron.compat.runtime.zero.config import (
        DeepSpeedZeroConfig,
        DeepSpeedZeroOffloadOptimizerConfig,
        DeepSpeedZeroOffloadParamConfig,
    )

    with pytest.warns(UserWarning, match="cpu_offload_param is deprecated"):
        assert isinstance(DeepSpeedZeroConfig(cpu_offload_param=True).offload_param, DeepSpeedZeroOffloadParamConfig)
    with pytest.warns(UserWarning, match="cpu_offload is deprecated"):
        off = DeepSpeedZeroConfig(cpu_offload=True).offload_optimizer
    assert isinstance(off, DeepSpeedZeroOffloadOptimizerConfig) and off.device == "cpu"
    with pytest.warns(UserWarning):
        assert DeepSpeedZeroConfig(stage3_gather_fp16_weights_on_model_save=True).gather_16bit_weights_on_model_save
    with pytest.warns(UserWarning, match="no effect"):
        assert DeepSpeedZeroConfig(stage=3, cpu_offload_use_pin_memory=True).offload_param is None
    with pytest.raises(ConfigError, match="deprecated name for zero_optimization.offload_optimizer"):
        DeepSpeedZeroConfig(cpu_offload=False, offload_optimizer={"device": "cpu"})
    assert [DeepSpeedZeroConfig(stage=s).overlap_comm for s in range(4)] == [False, False, False, True]
    assert DeepSpeedZeroConfig(stage=1, overlap_comm=True).overlap_comm
    assert DeepSpeedZeroConfig().pipeline_loading_checkpoint is False
    assert DeepSpeedZeroOffloadOptimizerConfig(pipeline_write=True).pipeline
    assert not DeepSpeedZeroOffloadOptimizerConfig().pipeline
    with pytest.warns(UserWarning, match="deprecated"):
        cfg = zerotron.Config.load({"train_batch_size": 1, "zero_optimization": True, "allgather_size": 1000})
    assert (cfg.zero_optimization.stage, cfg.zero_optimization.allgather_bucket_size) == (1, 1000)


def test_true_and_false_may_be_written_1_and_0_everywhere():
    cfg = zerotron.Config.load(
        {"train_batch_size": 1, "zero_allow_untested_optimizer": 1, "bf16": {"enabled": 1}, "fp16": {"enabled": 0}}
    )
    assert cfg.zero_allow_untested_optimizer is True and cfg.bf16.enabled is True and cfg.model_dtype_name == "bf16"
    with pytest.raises(ConfigError, match="progressive_layer_drop"):  # raw "enabled" reads follow the same rule
        zerotron.Config.load({"train_batch_size": 1, "progressive_layer_drop": {"enabled": 1}})
    for wrong in (2, "true", 0.5):
        with pytest.raises(ConfigError, match=r"expected true or false \(or 1 / 0\)"):
            zerotron.Config.load({"train_batch_size": 1, "zero_allow_untested_optimizer": wrong})


def test_deepspeed_transformer_layer_imports_and_refuses_by_name():
    from zerotron.compat.transformer_kernel import DeepSpeedTransformerConfig, DeepSpeedTransformerLayer

    config = DeepSpeedTransformerConfig(batch_size=2, hidden_size=16, heads=2, pre_layer_norm=False)
    assert (config.hidden_size, config.pre_layer_norm, config.layer_norm_eps) == (16, False, 1e-12)
    with pytest.raises(NotImplementedError, match="fused CUDA transformer kernel.*own transformer layers"):
        DeepSpeedTransformerLayer(config)
    assert zerotron.DeepSpeedTransformerLayer is DeepSpeedTransformerLayer  # `from deepspeed import ...`


def test_init_inference_is_refused_by_name_with_what_to_do_instead():
    from zerotron.inference import init_inference  # `deepspeed.inference` (the rename way's path)

    for call in (zerotron.init_inference, init_inference):
        with pytest.raises(NotImplementedError, match="DeepSpeed-Inference.*generate"):
            call(torch.nn.Linear(2, 2), dtype=torch.float16)


def test_dynamic_scaling_settings_are_checked_only_where_dynamic_scaling_reads_them():
    for fp16 in ({"enabled": True, "loss_scale": 128}, {"enabled": False}):  # static scale, or no fp16: unused
        cfg = zerotron.Config.load(
            {"train_batch_size": 1, "fp16": {**fp16, "loss_scale_window": 0, "min_loss_scale": -1}}
        )
        assert (cfg.fp16.loss_scale_window, cfg.fp16.min_loss_scale) == (0, -1)
    with pytest.raises(ConfigError, match="loss_scale_window"):
        zerotron.Config.load({"train_batch_size": 1, "fp16": {"enabled": True, "loss_scale_window": 0}})
