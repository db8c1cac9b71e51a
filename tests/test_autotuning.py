"""DeepSpeed's autotuning, predicted by the planner: the search itself (planner/tune.py), initialize() with the
autotuning section or "auto" batch sizes, and `zerotron run --autotuning` (a probe run, then the tuned run)."""

import json
import os
import subprocess
import sys
import warnings
from dataclasses import replace

import pytest
import torch

import zerotron
from zerotron.autotuning.launch import map_arguments
from zerotron.errors import ConfigError
from zerotron.models.gpt import GPT, GPTConfig
from zerotron.planner.cost import fits, memory, throughput
from zerotron.planner.hardware import hardware, this_machine
from zerotron.planner.layout import Layout
from zerotron.planner.model import ModelShape
from zerotron.planner.tune import MARGIN, tune

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def _no_process_group_left_behind():
    """initialize() in this process makes a one-rank process group: later tests expect none."""
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _largest_fitting(shape, gpus, hw, seq, stage, top=64):
    """By brute force: the largest micro-batch up to `top` that fits at `stage`, and its predicted tokens/s."""
    best = None
    for m in range(1, top + 1):
        layout = Layout(dp=gpus, zero=stage, micro_batch=m)
        mem = memory(shape, layout, seq, "bf16")
        if fits(mem, hw, hw.gpus_per_node) is None:
            best = (m, throughput(shape, layout, seq, hw, "bf16")["tokens_per_s"])
    return best


@pytest.mark.parametrize("model,gpus", [("1.3b", 8), ("7b", 8), ("7b", 64)])
def test_tune_takes_each_stages_largest_fitting_micro_batch_and_the_fastest_stage(model, gpus):
    shape, hw = ModelShape.parse(model), hardware("h100")
    best, trials = tune(shape, gpus, hw, 2048, max_micro_batch=64)
    expected = {s: _largest_fitting(shape, gpus, hw, 2048, s) for s in range(4)}
    chosen = {t.layout.zero: t.layout.micro_batch for t in trials if t.rejected is None}
    assert chosen == {s: v[0] for s, v in expected.items() if v is not None}
    # a higher stage only when it beats every lower one by the margin
    winner = None
    for stage in range(4):
        if expected[stage] and (winner is None or expected[stage][1] > expected[winner][1] * (1 + MARGIN)):
            winner = stage
    assert (best.layout.zero, best.layout.micro_batch) == (winner, expected[winner][0])
    assert best.rejected is None


def test_tune_keeps_a_fixed_global_batch_and_caps_the_micro_batch():
    shape, hw = ModelShape.parse("1.3b"), hardware("h100")
    best, _ = tune(shape, 8, hw, 2048, train_batch=96)
    layout = best.layout
    assert layout.micro_batch * layout.grad_accum * 8 == 96 and 12 % layout.micro_batch == 0
    best, _ = tune(shape, 8, hw, 2048, stages=(1,), max_micro_batch=3)
    assert best.layout.micro_batch == 3
    best, _ = tune(shape, 8, hw, 2048, stages=(1,), max_train_batch=16)
    assert best.layout.micro_batch == 2  # 2 x 8 ranks = 16


def test_tune_says_when_nothing_fits():
    with pytest.raises(ValueError, match="no micro-batch fits at ZeRO stage 0"):
        tune(ModelShape.parse("7b"), 1, hardware("a100-40"), 4096, stages=(0,))


def _tiny_gpt(max_seq_len=64):
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_head=2, n_kv_head=2, d_model=32, vocab_size=64, max_seq_len=max_seq_len))


def test_initialize_with_the_autotuning_section_applies_the_planners_choice():
    model = _tiny_gpt()
    cfg = {
        "train_micro_batch_size_per_gpu": "auto",
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "autotuning": {"enabled": True, "fast": True, "tuner_num_trials": 3, "max_train_micro_batch_size_per_gpu": 24},
    }
    with pytest.warns(UserWarning, match="change nothing here: fast, tuner_num_trials"):
        engine, *_ = zerotron.initialize(model=model, config=cfg)
    best, _ = tune(ModelShape.of_gpt(model.config), 1, this_machine(1), 64, "fp32", max_micro_batch=24)
    assert engine.train_micro_batch_size_per_gpu() == best.layout.micro_batch == 24
    assert engine.zero_optimization_stage() == best.layout.zero
    x = torch.randint(0, 64, (24, 16))
    engine.backward(engine(x, x))
    engine.step()


def test_auto_batch_sizes_with_nothing_to_derive_them_from_are_planned():
    # the config the Hugging Face docs write, handed to initialize() without the Trainer: the ZeRO stage stays
    cfg = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 2}}
    engine, *_ = zerotron.initialize(model=_tiny_gpt(), config=cfg)
    assert engine.zero_optimization_stage() == 2
    assert engine.train_micro_batch_size_per_gpu() == 1024  # DeepSpeed's default cap: a tiny model fits it
    # a number to derive from: "auto" resolves as the Trainer resolves it, no planner
    engine, *_ = zerotron.initialize(model=_tiny_gpt(), config={**cfg, "train_batch_size": 8})
    assert engine.train_micro_batch_size_per_gpu() == 8


def test_autotuning_needs_a_model_it_can_read_or_its_model_info():
    cfg = {"train_micro_batch_size_per_gpu": "auto", "autotuning": {"enabled": True}}
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    with pytest.raises(ConfigError, match="model_info"):
        zerotron.initialize(model=model, config=cfg)
    info = {"num_params": 72, "hidden_size": 8, "num_layers": 1}
    with pytest.raises(ConfigError, match="sequence length"):  # nothing states how long the inputs are
        zerotron.initialize(model=model, config={**cfg, "autotuning": {"enabled": True, "model_info": info}})
    with pytest.raises(ConfigError, match="autotuning.tuner_typo"):
        zerotron.initialize(model=_tiny_gpt(), config={**cfg, "autotuning": {"enabled": True, "tuner_typo": 1}})


def test_a_disabled_section_changes_nothing():
    cfg = {"train_micro_batch_size_per_gpu": 3, "autotuning": {"enabled": False, "fast": True}}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        engine, *_ = zerotron.initialize(model=_tiny_gpt(), config=cfg)
    assert engine.train_micro_batch_size_per_gpu() == 3


def test_arg_mappings_replace_or_append_the_scripts_flags():
    args = ["--deepspeed", "c.json", "--per_device_train_batch_size", "64"]
    mappings = {
        "train_micro_batch_size_per_gpu": "--per_device_train_batch_size",
        "gradient_accumulation_steps ": "--gradient_accumulation_steps",  # (the examples' trailing space)
    }
    out = map_arguments(args, {"train_micro_batch_size_per_gpu": 12, "gradient_accumulation_steps": 2}, mappings)
    assert out == ["--deepspeed", "c.json", "--per_device_train_batch_size", "12", "--gradient_accumulation_steps", "2"]


SCRIPT = """
import argparse, json, torch, zerotron as deepspeed
from zerotron.models.gpt import GPT, GPTConfig
p = argparse.ArgumentParser(); p.add_argument("--batch", type=int, default=2); p.add_argument("--out")
p = deepspeed.add_config_arguments(p); args = p.parse_args()
torch.manual_seed(0)
model = GPT(GPTConfig(n_layer=2, n_head=2, n_kv_head=2, d_model=32, vocab_size=64, max_seq_len=256))
cfg = json.load(open(args.deepspeed_config))
if cfg.get("train_micro_batch_size_per_gpu") == "auto":
    cfg["train_micro_batch_size_per_gpu"] = args.batch  # as the Trainer fills "auto" from its flag
engine, *_ = deepspeed.initialize(model=model, config=cfg)
x = torch.randint(0, 64, (engine.train_micro_batch_size_per_gpu(), 16))
engine.backward(engine(x, x)); engine.step()
if engine.global_rank == 0:
    json.dump({"batch": args.batch, "stage": engine.zero_optimization_stage()}, open(args.out, "w"))
"""


def test_zerotron_run_autotuning_probes_then_runs_the_tuned_config(tmp_path):
    (tmp_path / "train.py").write_text(SCRIPT)
    section = {
        "enabled": True,
        "max_train_micro_batch_size_per_gpu": 40,
        "arg_mappings": {"train_micro_batch_size_per_gpu": "--batch"},
    }
    (tmp_path / "ds.json").write_text(
        json.dumps(
            {
                "train_micro_batch_size_per_gpu": "auto",
                "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                "autotuning": section,
            }
        )
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE"):
        env.pop(k, None)
    args = ["run", "-n", "2", "--autotuning", "run", "train.py", "--deepspeed_config", "ds.json", "--batch", "3"]
    out = subprocess.run(
        [sys.executable, "-m", "zerotron.cli", *args + ["--out", "out.json"]],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    probe = json.loads((tmp_path / "autotuning_exps/profile_model_info/model_info.json").read_text())
    assert probe["seq"] == 16 and probe["world_size"] == 2 and probe["max_positions"] == 256
    tuned = json.loads((tmp_path / "autotuning_results/ds_config_optimal.json").read_text())
    best, _ = tune(ModelShape(**probe["shape"]), 2, this_machine(2), 16, "fp32", max_micro_batch=40)
    assert tuned["train_micro_batch_size_per_gpu"] == best.layout.micro_batch == 40
    assert tuned["zero_optimization"]["stage"] == best.layout.zero and "autotuning" not in tuned
    ran = json.loads((tmp_path / "out.json").read_text())
    assert ran == {"batch": 40, "stage": best.layout.zero}  # the flag mapped, the tuned config read
    command = (tmp_path / "autotuning_results/cmd_optimal.txt").read_text()
    assert "--deepspeed_config autotuning_results/ds_config_optimal.json --batch 40" in command
    # overwrite false (DeepSpeedExamples' configs): the results there are used, nothing is probed again
    section["overwrite"] = False
    (tmp_path / "ds.json").write_text(json.dumps({"train_micro_batch_size_per_gpu": "auto", "autotuning": section}))
    (tmp_path / "autotuning_results/ds_config_optimal.json").write_text(
        json.dumps({**tuned, "train_micro_batch_size_per_gpu": 7})
    )
    (tmp_path / "autotuning_exps/profile_model_info/model_info.json").unlink()
    args[4] = "tune"
    out = subprocess.run(
        [sys.executable, "-m", "zerotron.cli", *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "--batch 7" in (tmp_path / "autotuning_results/cmd_optimal.txt").read_text()
    assert not (tmp_path / "autotuning_exps/profile_model_info/model_info.json").exists()


def test_a_hugging_face_models_shape_counts_its_losss_logit_copies():
    from transformers import GPT2Config, GPT2LMHeadModel

    from zerotron.autotuning.model_info import model_shape

    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2, n_positions=64, vocab_size=100))
    shape = model_shape(model, None)
    assert (shape.layers, shape.hidden, shape.vocab, shape.gated, shape.loss_copies) == (2, 32, 100, False, 2)
    plain = Layout(dp=1, micro_batch=4)
    extra = (
        memory(shape, plain, 64, "fp32")["buffers"]
        - memory(replace(shape, loss_copies=0), plain, 64, "fp32")["buffers"]
    )
    assert extra == 2 * 4 * 4 * 64 * 100  # two more fp32 logits of 4 x 64 tokens


def test_an_encoders_own_config_names_give_its_shape(tmp_path):
    """DistilBERT's config says dim / n_heads / n_layers (autotuning's distilbert example was refused as a model
    without a config); its feed-forward is not gated, as BERT's intermediate_size would make it."""
    from transformers import DistilBertConfig, DistilBertForSequenceClassification

    from zerotron.autotuning.model_info import model_shape

    config = DistilBertConfig(vocab_size=100, dim=32, n_layers=3, n_heads=2, hidden_dim=96)
    shape = model_shape(DistilBertForSequenceClassification(config), None)
    assert (shape.layers, shape.hidden, shape.heads, shape.ffn, shape.vocab, shape.gated) == (3, 32, 2, 96, 100, False)
    config.save_pretrained(tmp_path)  # `zerotron plan --model DIR` reads the same names from config.json
    assert replace(ModelShape.parse(str(tmp_path)), loss_copies=shape.loss_copies) == shape


def test_a_gated_mlp_is_told_by_the_activation_not_by_intermediate_size():
    """BERT, DeBERTa, GPT-NeoX and Phi-2 name their two-matrix GELU MLP intermediate_size too (the run_glue
    examples' encoders were predicted with a third matrix); SiLU families and Gemma's GeGLU are gated."""
    import transformers as hf

    gated = {
        name: ModelShape.from_hf_config(getattr(hf, name)().to_dict()).gated
        for name in ("BertConfig", "DebertaV2Config", "GPTNeoXConfig", "PhiConfig", "LlamaConfig", "GemmaConfig")
    }
    assert [n for n, g in gated.items() if g] == ["LlamaConfig", "GemmaConfig"]
