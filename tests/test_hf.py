"""Hugging Face Transformers models (built from tiny configs, random weights, no downloads)."""

import types

import pytest
import torch
import transformers  # noqa: F401,E402  (installed by the test extra)
from distributed import run_ranks
from parity import assert_losses_close, ds_config, global_batches, hf_loss, reference_training

import zerotron

STEPS = 3
FAMILIES = ("llama", "mistral", "qwen2", "gpt2")


def make(kind, **extra):
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, MistralConfig, Qwen2Config

    torch.manual_seed(0)
    common = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        **extra,
    )
    if kind == "gpt2":
        cfg = GPT2Config(
            vocab_size=256,
            n_embd=64,
            n_layer=2,
            n_head=4,
            n_positions=64,
            bos_token_id=0,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            eos_token_id=0,
            **extra,
        )
    else:
        cfg = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config}[kind](**common)
    cfg._attn_implementation = "sdpa"
    return AutoModelForCausalLM.from_config(cfg)


def reference(kind, rows=4, **extra):
    return reference_training(global_batches(STEPS, rows), model=make(kind, **extra), forward=hf_loss)[0]


def _train(kind, stage, tp=1, extra=None, grad_ckpt=False):
    import torch.distributed as dist

    model = make(kind)
    if grad_ckpt:  # Transformers' own checkpointing: it calls each layer through torch's checkpoint
        if hasattr(model, "activation_checkpointing_enable"):  # Transformers >= 5.2x
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    dp = dist.get_world_size() // tp
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0, **(extra or {})}
    config = ds_config(4 // dp, 1, zero_optimization=zero, tensor_parallel={"autotp_size": tp})
    engine, *_ = zerotron.initialize(model=model, config=config)
    losses = []
    for x, _ in global_batches(STEPS, 4):
        mine = x.chunk(dp)[engine.coords.dp]
        losses.append(engine.train_batch(iter([{"input_ids": mine, "labels": mine}])).item())
    return losses


@pytest.mark.parametrize("kind", FAMILIES)
@pytest.mark.parametrize("stage", [1, 3])
def test_zero_parity(kind, stage):
    ref = reference(kind)
    for losses in run_ranks(_train, 2, kind, stage):
        assert_losses_close(losses, ref, rtol=1e-5)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_zero2_with_offload_and_gradient_checkpointing(kind):
    ref = reference(kind)
    extra = {"offload_optimizer": {"device": "cpu"}}
    for losses in run_ranks(_train, 2, kind, 2, 1, extra, True):
        assert_losses_close(losses, ref, rtol=1e-5)


def test_zero3_with_transformers_gradient_checkpointing():
    ref = reference("llama")
    for losses in run_ranks(_train, 2, "llama", 3, 1, None, True):
        assert_losses_close(losses, ref, rtol=1e-5)


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2", "gpt2"])
def test_tensor_parallel_from_the_model_plan(kind):
    ref = reference(kind)
    for losses in run_ranks(_train, 2, kind, 0, 2):
        assert_losses_close(losses, ref, rtol=1e-5)


def test_plan_translation_and_errors():
    from zerotron.errors import ConfigError
    from zerotron.hf import tensor_parallel_plan

    plan = tensor_parallel_plan(make("llama"), 2)
    assert plan["model.layers.*.self_attn.q_proj"] == "column" and plan["model.layers.*.mlp.down_proj"] == "row"
    assert plan["model.embed_tokens"] == "vocab" and plan["lm_head"] == "column_gathered"
    with pytest.raises(ConfigError, match="key/value heads \\(2\\) must be divisible"):
        tensor_parallel_plan(make("llama"), 4)


def test_resolve_config_fills_auto_like_the_trainer():
    from zerotron.hf import resolve_config

    args = types.SimpleNamespace(
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        learning_rate=3e-4,
        adam_beta1=0.9,
        adam_beta2=0.98,
        adam_epsilon=1e-7,
        weight_decay=0.01,
        max_grad_norm=0.5,
        fp16=False,
        bf16=True,
        warmup_steps=0,
        warmup_ratio=0.1,
        max_steps=200,
    )
    ds = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "bf16": {"enabled": "auto"},
        "fp16": {"enabled": "auto"},
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"},
        },
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {
                "warmup_min_lr": "auto",
                "warmup_max_lr": "auto",
                "warmup_num_steps": "auto",
                "total_num_steps": "auto",
            },
        },
        "zero_optimization": {
            "stage": 3,
            "reduce_bucket_size": "auto",
            "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto",
        },
    }
    out = resolve_config(ds, args, make("llama"))
    assert out["train_micro_batch_size_per_gpu"] == 4 and out["gradient_accumulation_steps"] == 2
    assert out["gradient_clipping"] == 0.5 and out["bf16"]["enabled"] is True and out["fp16"]["enabled"] is False
    assert out["optimizer"]["params"] == {"lr": 3e-4, "betas": [0.9, 0.98], "eps": 1e-7, "weight_decay": 0.01}
    assert out["scheduler"]["params"] == {
        "warmup_min_lr": 0.0,
        "warmup_max_lr": 3e-4,
        "warmup_num_steps": 20,
        "total_num_steps": 200,
    }
    zero = out["zero_optimization"]
    assert zero["reduce_bucket_size"] == 64 * 64 and zero["stage3_param_persistence_threshold"] == 640


def _generate(kind):
    import torch.distributed as dist

    model = make(kind)
    engine, *_ = zerotron.initialize(
        model=model, config=ds_config(1, 1, zero_optimization={"stage": 3, "stage3_param_persistence_threshold": 0})
    )
    prompt = torch.tensor([[5, 6, 7, 8]])
    # ranks stop at different lengths: the finished rank keeps joining the gathers until all are done
    new = 3 if dist.get_rank() == 0 else 9
    out = zerotron.hf.generate(engine, prompt, max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0].tolist()


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_generation_under_zero3_with_ranks_stopping_at_different_lengths(kind):
    short, long = run_ranks(_generate, 2, kind, timeout=90)
    model = make(kind).eval()
    want = model.generate(
        torch.tensor([[5, 6, 7, 8]]), max_new_tokens=9, do_sample=False, eos_token_id=None, pad_token_id=0
    )[0].tolist()
    assert long == want and short == want[: len(short)] and len(short) == 7


# ---- Hugging Face directories in and out -----------------------------------------------------------
def _round_trip(source, out, stage, tp, kind="llama"):
    import torch.distributed as dist

    torch.manual_seed(123)  # different weights from the file's: the load must replace them all
    model = make(kind)
    model.apply(lambda m: m.reset_parameters() if hasattr(m, "reset_parameters") else None)
    dp = dist.get_world_size() // tp
    config = ds_config(
        4 // dp,
        1,
        zero_optimization={"stage": stage, "stage3_param_persistence_threshold": 0},
        tensor_parallel={"autotp_size": tp},
    )
    engine, *_ = zerotron.initialize(model=model, config=config)
    zerotron.hf.load_hf_weights(engine, source)
    losses = []
    for x, _ in global_batches(2, 4):
        mine = x.chunk(dp)[engine.coords.dp]
        losses.append(engine.train_batch(iter([{"input_ids": mine, "labels": mine}])).item())
    zerotron.hf.save_hf_pretrained(engine, out, max_shard_size=40_000)  # small shards: exercise the index
    engine.module.eval()
    with torch.no_grad():
        logits = engine(input_ids=global_batches(1, 2, seed=9)[0][0]).logits
    return losses, logits


@pytest.mark.parametrize("kind,stage,tp", [("llama", 3, 1), ("llama", 1, 2), ("gpt2", 3, 1), ("gpt2", 0, 2)])
def test_hf_directory_round_trip(tmp_path, kind, stage, tp):
    from transformers import AutoModelForCausalLM

    source, out = tmp_path / "source", tmp_path / "out"
    make(kind).save_pretrained(source)  # seed 0 weights
    ref = reference(kind)[:2]  # the same weights trained in one process
    results = run_ranks(_round_trip, 2, str(source), str(out), stage, tp, kind)
    assert (out / "model.safetensors.index.json").exists() and (out / "config.json").exists()
    reloaded = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        want = reloaded(input_ids=global_batches(1, 2, seed=9)[0][0]).logits
    for losses, logits in results:
        assert_losses_close(losses, ref, rtol=1e-5)
        assert torch.allclose(logits, want, atol=1e-5, rtol=0)


def _checkpoint_hf(directory):
    model = make("llama")
    engine, *_ = zerotron.initialize(model=model, config=ds_config(2, 1, zero_optimization={"stage": 2}))
    x = global_batches(1, 4)[0][0].chunk(2)[engine.coords.dp]
    engine.train_batch(iter([{"input_ids": x, "labels": x}]))
    engine.save_checkpoint(directory)
    engine.module.eval()
    with torch.no_grad():
        return engine(input_ids=global_batches(1, 2, seed=9)[0][0]).logits


def test_convert_writes_a_hugging_face_directory(tmp_path):
    from transformers import AutoModelForCausalLM

    from zerotron.checkpoint.export import convert

    logits = run_ranks(_checkpoint_hf, 2, str(tmp_path / "ck"))[0]
    convert(tmp_path / "ck", tmp_path / "hf", "fp32", max_shard_size=50_000)
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        want = reloaded(input_ids=global_batches(1, 2, seed=9)[0][0]).logits
    assert torch.allclose(logits, want, atol=1e-5, rtol=0)


# ---- pipeline parallelism ------------------------------------------------------------------------------
def _pipeline(kind, tie, stage, tp, gas=4):
    import torch.distributed as dist

    model = make(kind, **({} if kind == "gpt2" else {"tie_word_embeddings": tie}))
    module = zerotron.hf.to_pipeline(model, 2)
    dp = dist.get_world_size() // (2 * tp)
    config = ds_config(
        4 // (dp * gas) or 1, gas, zero_optimization={"stage": stage}, tensor_parallel={"autotp_size": tp}
    )
    engine, *_ = zerotron.initialize(model=module, config=config)
    losses = []
    for x, _ in global_batches(STEPS, 4):
        mine = x.chunk(dp)[engine.coords.dp]
        losses.append(engine.train_batch(iter([(m, m) for m in mine.chunk(gas)])).item())
    return losses


@pytest.mark.parametrize(
    "kind,tie,world,stage,tp",
    [
        ("llama", False, 2, 0, 1),
        ("qwen2", True, 2, 1, 1),
        ("gpt2", True, 2, 0, 1),
        ("llama", False, 4, 0, 2),
        ("gpt2", True, 4, 1, 2),
    ],
)
def test_pipeline_parity(kind, tie, world, stage, tp):
    """GPT-2 ties its embeddings by default; the Llama-family cases choose."""
    ref = reference(kind, **({} if kind == "gpt2" else {"tie_word_embeddings": tie}))
    for losses in run_ranks(_pipeline, world, kind, tie, stage, tp, timeout=120):
        assert_losses_close(losses, ref, rtol=1e-5)
