"""DeepSpeed config compatibility: optimizer names and parameters, the keys zerotron warns about, refuses
or reads under another name, and the config survey script (tools/config_survey.py)."""

import json
import warnings

import pytest
import torch

from zerotron import Config, ConfigError
from zerotron.ops.adagrad import DeepSpeedCPUAdagrad
from zerotron.ops.adam import CPUAdam, FusedAdam
from zerotron.ops.lamb import FusedLamb
from zerotron.ops.lion import DeepSpeedCPULion, FusedLion
from zerotron.optim import build_optimizer


def _messages(record):
    return " | ".join(str(w.message) for w in record)


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
    assert "zerotron applies every gradient at every step" in text  # (ZenFlow trains another model: said so)


@pytest.mark.parametrize(
    "extra,key",
    [
        ({"progressive_layer_drop": {"enabled": True, "theta": 0.5}}, "progressive_layer_drop.enabled"),
        ({"curriculum_learning": {"enabled": True}}, "curriculum_learning.enabled"),
        ({"elasticity": {"enabled": True, "max_train_batch_size": 64}}, "elasticity.enabled"),
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
    assert off.device == "cpu" and not off.pin_memory  # cpu_offload_use_pin_memory: no effect, as in DeepSpeed
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
