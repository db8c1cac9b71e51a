"""No DeepSpeed config key is silently ignored: every key of a sample of public configs (DeepSpeedExamples and
DeepSpeed's docs, copied into tests/data/deepspeed_configs) is used, changes nothing by design (reviewed, with
why), is warned about with what to do instead, or is refused (tools/config_survey.py classifies them)."""

from __future__ import annotations

import pathlib
import warnings

import pytest

from tools.config_keys import classify_keys, key_survey, parsed_fields, read_by_zerotron
from tools.config_survey import find_configs, prepare, resolve_like_hf, world_size_for
from zerotron import Config, ConfigError
from zerotron.config import no_effect

DATA = pathlib.Path(__file__).parent / "data" / "deepspeed_configs"


def _sample():
    out = []
    for _, raw, _ in find_configs([str(DATA)]):
        prepared, _ = prepare(raw)
        out.append((resolve_like_hf(prepared), world_size_for(prepared)[0]))
    return out


def test_public_configs_have_no_silently_ignored_key():
    sample = _sample()
    assert len(sample) == len(list(DATA.glob("*.json")))
    counts, examples = key_survey(sample)
    assert counts["silently ignored"] == 0, dict(examples["silently ignored"])
    # every class shows up in the sample, so the classification is exercised
    assert all(counts[c] > 0 for c in ("used", "no effect", "warned", "error")), counts
    assert examples["used"]["flops_profiler.profile_step"] == 1 and examples["error"]["optimizer.type"] >= 1


def test_a_key_nothing_handles_is_counted_as_silently_ignored(monkeypatch):
    raw = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2, "overlap_comm": True}}
    assert classify_keys(raw, 1)["zero_optimization.overlap_comm"] == "no effect"
    monkeypatch.setattr(no_effect, "PARSED_NO_EFFECT", {})  # forget why it changes nothing
    assert classify_keys(raw, 1)["zero_optimization.overlap_comm"] == "silently ignored"
    assert classify_keys(raw, 1)["zero_optimization.stage"] == "used"


def test_every_parsed_key_is_read_by_zerotron_or_reviewed():
    """A key parsed into a section but read by no code outside the config would be silently ignored."""
    unread = [p for p in parsed_fields() if not read_by_zerotron(p)]
    reviewed = set(no_effect.PARSED_NO_EFFECT) | set(no_effect.ONLY_AT_DEFAULT)
    checkpoint = [p for p in unread if p.startswith("checkpoint.")]  # (warned by its section when set)
    assert [p for p in unread if p not in reviewed and p not in checkpoint] == []


def _warnings(raw):
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        Config.load({"train_micro_batch_size_per_gpu": 1, **raw})
    return [str(w.message) for w in record]


@pytest.mark.parametrize(
    "raw, named",
    [
        ({"memory_breakdown": True}, "engine.memory_report()"),
        ({"dataloader_drop_last": False}, "build your DataLoader yourself"),
        ({"bf16": {"enabled": True}, "gradient_accumulation_dtype": "fp32"}, "gradients accumulate in the model dtype"),
        ({"fp16": {"enabled": True, "auto_cast": True}}, "feed the model fp16 inputs yourself"),
        ({"hybrid_engine": {"enabled": True}}, "module.generate() runs the training model itself"),
        ({"compression_training": {"weight_quantization": {}}}, "after training"),
        ({"checkpoint": {"checkpoint_serialization": False}}, "zerotron writes the zip one"),
    ],
)
def test_keys_that_ask_for_what_zerotron_does_not_do_are_warned_with_what_to_do(raw, named):
    (text,) = _warnings(raw)
    assert named in text and "what to do instead" in text


@pytest.mark.parametrize(
    "raw",
    [
        {"memory_breakdown": False, "dump_state": False, "dataloader_drop_last": True},
        {"bf16": {"enabled": True}, "gradient_accumulation_dtype": "bf16"},
        {"hybrid_engine": {"enabled": False}, "data_efficiency": {"enabled": False}},
        {"flops_profiler": {"enabled": True, "output_file": "x.txt"}, "comms_logger": {"enabled": True}},
        {"checkpoint": {"checkpoint_serialization": True}},
    ],
)
def test_keys_at_the_value_zerotron_has_load_without_a_word(raw):
    assert _warnings(raw) == []


def test_profiler_sections_are_typed():
    cfg = Config.load({"train_micro_batch_size_per_gpu": 1, "flops_profiler": {"enabled": True, "top_modules": 3}})
    assert cfg.flops_profiler.top_modules == 3 and cfg.flops_profiler.profile_step == 1
    assert cfg["comms_logger"]["prof_all"] is True  # read back as DeepSpeed-written code reads it
    with pytest.raises(ConfigError, match="comms_logger.prof_ops"):
        Config.load({"train_micro_batch_size_per_gpu": 1, "comms_logger": {"prof_ops": "all_reduce"}})
    with pytest.raises(ConfigError, match="log_level"):
        Config.load({"train_micro_batch_size_per_gpu": 1, "log_level": "loud"})


# A script in the shape of DeepSpeed-Chat's ds_utils.py and DeepSpeedExamples' AutoTP / SuperOffload scripts: a
# config built by a function from its arguments' defaults, argparse defaults, a dtype chosen by branch, keys added
# by assignment, a training checkpoint's dict (not a config), and a here-document with shell variables.
_SCRIPT = """
import argparse
GLOBAL_BATCH = 32
parser = argparse.ArgumentParser()
parser.add_argument("--dp_size", type=int, default=2)
parser.add_argument("--offload", action="store_true")
def config(args, dtype, stage=2):
    if dtype == "fp16":
        name, section = "fp16", {"enabled": True, "loss_scale_window": 100}
    else:
        name, section = "bf16", {"enabled": True}
    zero = {"stage": stage, "offload_optimizer": {"device": "cpu" if args.offload else "none"}}
    zero["overlap_comm"] = True
    return {"train_batch_size": GLOBAL_BATCH * args.dp_size, "zero_optimization": zero, name: section,
            "data_parallel_size": args.dp_size, "wall_clock_breakdown": not args.offload}
def save(model, optimizer):
    return {"epoch": 1, "optimizer": optimizer.state_dict()}
"""
_SHELL = """BATCH_SIZE=${2:-4}
OUT=/tmp/run
cat > "$OUT/ds.json" << EOT
{"train_batch_size": $BATCH_SIZE, "zero_optimization": {"stage": $STAGE}, "tensorboard": {"output_path": "$OUT/tb"}}
EOT
"""


def test_inline_configs_are_rebuilt_as_the_script_builds_them():
    from tools.config_inline import python_configs, shell_configs

    zero = {"stage": 2, "offload_optimizer": {"device": "none"}, "overlap_comm": True}
    common = {"train_batch_size": 64, "zero_optimization": zero, "data_parallel_size": 2, "wall_clock_breakdown": True}
    assert python_configs(_SCRIPT) == [
        {**common, "fp16": {"enabled": True, "loss_scale_window": 100}},
        {**common, "bf16": {"enabled": True}},
    ]
    assert shell_configs(_SHELL) == (
        [{"train_batch_size": 4, "zero_optimization": {"stage": 1}, "tensorboard": {"output_path": "/tmp/run/tb"}}],
        0,
    )
    for raw in python_configs(_SCRIPT):
        assert "silently ignored" not in classify_keys(raw, world_size_for(raw)[0]).values()
