"""Config sources: a path, a pathlib.Path, a dict, inline JSON and a Config load the same, and what is
wrong with a source (a missing file, bad JSON, not an object) is an error naming it.

Pure Python: no process groups.
"""

import json
import pathlib

import pytest
from config_helpers import ALL_AUTO, TBS, load, triple

from zerotron.config import Config, read_raw
from zerotron.errors import ConfigError


def test_missing_config_path(tmp_path):
    path = str(tmp_path / "nope" / "ds_config.json")
    with pytest.raises(ConfigError) as info:
        Config.load(path)
    message = str(info.value)
    assert info.value.key == "config" and "config key 'config'" in message
    assert path in message and "no such file" in message


def test_invalid_json_file_names_the_file(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('{"train_batch_size": 8,, }')
    with pytest.raises(ConfigError) as info:
        Config.load(str(path))
    message = str(info.value)
    assert "config key 'config'" in message
    assert str(path) in message and "not valid JSON" in message and "line 1" in message


def test_invalid_inline_json():
    with pytest.raises(ConfigError, match="config.*<inline JSON>.*not valid JSON"):
        Config.load('{"train_batch_size": }')


@pytest.mark.parametrize("text", ["[1, 2]", '"train_batch_size"', "8", "null"])
def test_non_object_json_file(tmp_path, text):
    path = tmp_path / "list.json"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        Config.load(path)
    message = str(info.value)
    assert "config key 'config'" in message and str(path) in message
    assert "object at the top level" in message


@pytest.mark.parametrize("source", [42, None, ["train_batch_size", 8], b"{}"])
def test_wrong_source_type(source):
    with pytest.raises(ConfigError) as info:
        Config.load(source)
    assert info.value.key == "config"
    assert type(source).__name__ in str(info.value)


@pytest.mark.parametrize("section", ["fp16", "zero_optimization", "optimizer"])
def test_section_that_is_not_an_object(section):
    with pytest.raises(ConfigError) as info:
        load({section: 3})
    assert info.value.key == section
    assert "JSON object" in str(info.value)


# =============================================================================== sources load the same
SOURCE = {
    "train_batch_size": 16,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0,
    "fp16": {"enabled": True, "loss_scale_window": 100, "hysteresis": 3},
    "optimizer": {"type": "AdamW", "params": {"lr": 2e-4, "betas": [0.9, 0.95]}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 5, "total_num_steps": 50}},
    "zero_optimization": {"stage": 0, "reduce_bucket_size": 5e8},
    "wall_clock_breakdown": False,
}


def test_path_dict_json_string_and_config_load_the_same(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(SOURCE, indent=2))
    from_dict = Config.load(SOURCE, world_size=2)
    from_str_path = Config.load(str(path), world_size=2)
    from_pathlib = Config.load(pathlib.Path(path), world_size=2)
    from_inline = Config.load(json.dumps(SOURCE), world_size=2)
    from_inline_ws = Config.load("  \n" + json.dumps(SOURCE), world_size=2)
    from_config = Config.load(from_dict, world_size=2)
    for cfg in (from_str_path, from_pathlib, from_inline, from_inline_ws, from_config):
        assert cfg == from_dict
        assert cfg.raw == SOURCE
    assert triple(from_dict) == (16, 4, 2)
    assert from_dict.fp16.hysteresis == 3 and from_dict.zero_optimization.reduce_bucket_size == 500_000_000


def test_config_round_trips_through_load():
    cfg = Config.load(ALL_AUTO, world_size=2, micro_batch_size=4, lr=1e-4, total_steps=10)
    again = Config.load(cfg, world_size=2)  # no auto values needed: raw holds the resolved values
    assert again == cfg
    assert again.raw == cfg.raw and again.raw is not cfg.raw
    assert "auto" not in json.dumps(cfg.raw)
    assert again.optimizer.params["lr"] == 1e-4
    assert triple(again) == (8, 4, 1)


def test_loading_copies_the_source():
    source = {"train_batch_size": 8, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    cfg = Config.load(source)
    source["optimizer"]["params"]["lr"] = 0.5
    source["train_batch_size"] = 4
    assert cfg.raw["optimizer"]["params"]["lr"] == 1e-3 and cfg.raw[TBS] == 8
    d = cfg.to_dict()
    d["optimizer"]["params"]["lr"] = 0.7
    assert cfg.raw["optimizer"]["params"]["lr"] == 1e-3
    r = read_raw(cfg)
    r[TBS] = 1
    assert cfg.raw[TBS] == 8
    assert cfg.optimizer.params["lr"] == 1e-3


def test_config_built_directly_and_old_bf16_name():
    from zerotron.config import BF16Config

    cfg = Config.load(Config(train_batch_size=8, bf16=BF16Config(enabled=True)), world_size=2)
    assert cfg.train_micro_batch_size_per_gpu == 4 and cfg.bf16.enabled
    assert Config.load({"train_batch_size": 4, "bfloat16": {"enabled": True}}).bf16.enabled
    with pytest.raises(ConfigError, match="bfloat16"):
        Config.load({"train_batch_size": 4, "bfloat16": {"enabled": True}, "bf16": {"enabled": False}})
