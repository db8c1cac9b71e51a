"""The Hugging Face Trainer on zerotron through the `deepspeed` import alias (issue 17 A).

examples/hf_trainer.py runs under torchrun on 2 ranks with ZEROTRON_AS_DEEPSPEED=1; each run with
`TrainingArguments(deepspeed=<the Transformers docs' all-"auto" ZeRO-2/ZeRO-3 config>)` is held
to the same script on plain DDP (no deepspeed argument): the Trainer's logged losses within 1e-5
relative, evaluate() alone, save (ZeRO-3 checkpoint-N/global_stepN + consolidated
model.safetensors) and resume to the same losses. The docs' "scheduler" block is left out (the
Trainer's own schedule is handed to the engine) because DeepSpeed's WarmupLR and the Trainer's
schedules differ by design; the model is built before TrainingArguments (not inside zero.Init), or
loaded with from_pretrained after it (inside zero.Init, each rank loading its pieces). The docs' CPU
offload configs run with gradient checkpointing and eval_on_start (an evaluate() at step 0).
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from distributed import free_port

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(900)  # torchrun runs of ~15 s each on an idle 2-core machine; the fixture makes four
SCRIPT = ROOT / "examples" / "hf_trainer.py"
RTOL = 1e-5

_COMMON = {
    "fp16": {"enabled": "auto"},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}
ZERO2 = dict(
    _COMMON,
    zero_optimization={
        "stage": 2,
        "offload_optimizer": {"device": "none"},
        "allgather_partitions": True,
        "allgather_bucket_size": 2e8,
        "overlap_comm": True,
        "reduce_scatter": True,
        "reduce_bucket_size": "auto",
        "contiguous_gradients": True,
    },
)
ZERO3 = dict(
    _COMMON,
    zero_optimization={
        "stage": 3,
        "offload_optimizer": {"device": "none"},
        "offload_param": {"device": "none"},
        "overlap_comm": True,
        "contiguous_gradients": True,
        "sub_group_size": 1e9,
        "reduce_bucket_size": "auto",
        "stage3_prefetch_bucket_size": "auto",
        "stage3_param_persistence_threshold": "auto",
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_gather_16bit_weights_on_model_save": True,
    },
)
_CPU = {"device": "cpu", "pin_memory": True}
ZERO2_OFFLOAD = dict(ZERO2, zero_optimization=dict(ZERO2["zero_optimization"], offload_optimizer=_CPU))
ZERO3_OFFLOAD = dict(
    ZERO3, zero_optimization=dict(ZERO3["zero_optimization"], offload_optimizer=_CPU, offload_param=_CPU)
)


def _run(tmp: Path, name: str, config=None, *extra, nproc=2):
    out = tmp / name
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--master_port",
        str(free_port()),
        str(SCRIPT),
        "--use-cpu",
        "--output-dir",
        str(out),
        "--history",
        str(tmp / f"{name}.json"),
        *extra,
    ]
    if "--init-from" not in extra:
        cmd.append("--model-first")
    if config is not None:
        path = tmp / f"{name}.ds.json"
        path.write_text(json.dumps(config))
        cmd += ["--deepspeed", str(path)]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_"))}
    env.update(
        ZEROTRON_AS_DEEPSPEED="1",
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]),
    )
    r = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{name} failed:\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    result = json.loads((tmp / f"{name}.json").read_text())
    if config is not None:  # zerotron's engine did the work, at the configured stage and TP size
        assert result["engine"].startswith("zerotron."), result["engine"]
        assert result["zero_stage"] == config["zero_optimization"]["stage"], result
        assert result["tp"] == config.get("tensor_parallel", {}).get("autotp_size", 1), result
    else:
        assert not result["engine"].startswith("zerotron."), result["engine"]
    return result


def _losses(result):
    return [(h["step"], h["loss"]) for h in result["history"] if "loss" in h]


def _close(a, b):
    return abs(a - b) <= RTOL * abs(b)


def _assert_same_losses(got, want):
    assert [s for s, _ in got] == [s for s, _ in want], (got, want)
    bad = [(s, g, w) for (s, g), (_, w) in zip(got, want) if not _close(g, w)]
    assert not bad, f"losses differ beyond {RTOL} relative (step, got, DDP): {bad}"


def _save_initial_model(path):
    """The weights examples/hf_trainer.py builds with --model-first (seed 0), saved for from_pretrained."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf_trainer")
    _save_initial_model(tmp / "init")
    return tmp, {
        "ddp": _run(tmp, "ddp", None, "--save-model", str(tmp / "ddp_model")),
        "ddp_eval": _run(tmp, "ddp_eval", None, "--eval-only"),
        "z2": _run(tmp, "z2", ZERO2),
        "z3": _run(tmp, "z3", ZERO3, "--save-steps", "3", "--save-model", str(tmp / "z3_model")),
    }


def test_zero2_matches_ddp(runs):
    _, r = runs
    assert len(_losses(r["ddp"])) == 6
    _assert_same_losses(_losses(r["z2"]), _losses(r["ddp"]))
    assert _close(r["z2"]["eval"]["eval_loss"], r["ddp"]["eval"]["eval_loss"])


def test_zero3_matches_ddp_and_saves_full_weights(runs):
    tmp, r = runs
    _assert_same_losses(_losses(r["z3"]), _losses(r["ddp"]))
    assert _close(r["z3"]["eval"]["eval_loss"], r["ddp"]["eval"]["eval_loss"])
    # checkpoint layout the Trainer resumes from, and the consolidated (ZeRO-3 gathered) weights
    ckpt = tmp / "z3" / "checkpoint-3"
    assert (ckpt / "global_step3").is_dir() and (ckpt / "latest").read_text().strip() == "global_step3"
    import torch
    from safetensors.torch import load_file

    got, want = (
        load_file(str(tmp / "z3_model" / "model.safetensors")),
        load_file(str(tmp / "ddp_model" / "model.safetensors")),
    )
    assert set(got) == set(want)
    for k in want:
        assert got[k].shape == want[k].shape, k
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-6, msg=k)


def test_evaluate_alone(runs):
    tmp, r = runs
    e = _run(tmp, "z3_eval", ZERO3, "--eval-only")  # an engine without an optimizer
    assert _close(e["eval"]["eval_loss"], r["ddp_eval"]["eval"]["eval_loss"]), (e["eval"], r["ddp_eval"]["eval"])


def test_resume_same_losses(runs):
    tmp, r = runs
    resumed = _run(tmp, "z3_resume", ZERO3, "--resume", str(tmp / "z3" / "checkpoint-3"))
    losses = _losses(resumed)
    _assert_same_losses(losses, _losses(r["ddp"]))
    assert losses[3:] == _losses(r["z3"])[3:], (losses, _losses(r["z3"]))  # bit for bit the uninterrupted run
    runtimes = [h for h in resumed["history"] if "train_runtime" in h]
    assert runtimes and runtimes[-1]["step"] == 6


@pytest.mark.parametrize(
    "name,config,extra",
    [
        ("z2_offload", ZERO2_OFFLOAD, ()),
        ("z3_offload", ZERO3_OFFLOAD, ("--init-from", "init")),  # from_pretrained inside zero.Init, then offloaded
    ],
)
def test_cpu_offload_with_gradient_checkpointing_and_eval_on_start(runs, name, config, extra):
    tmp, r = runs
    got = _run(tmp, name, config, "--gradient-checkpointing", "--eval-on-start", *extra)
    assert got["gradient_checkpointing"] and got["host_bytes"] > 0, got
    _assert_same_losses(_losses(got), _losses(r["ddp"]))
    at_start = [h["eval_loss"] for h in got["history"] if "eval_loss" in h and h["step"] == 0]
    assert len(at_start) == 1 and _close(at_start[0], r["ddp_eval"]["eval"]["eval_loss"]), got["history"]
    assert _close(got["eval"]["eval_loss"], r["ddp"]["eval"]["eval_loss"])


def test_torch_compile_through_engine_compile(runs):
    """TrainingArguments(torch_compile=True): accelerate calls engine.compile(backend=..., compile_kwargs=...)."""
    tmp, r = runs
    c = _run(tmp, "z3_compile", ZERO3, "--compile-backend", "eager")
    _assert_same_losses(_losses(c), _losses(r["ddp"]))


def test_autotp_matches_one_process(tmp_path):
    """tensor_parallel.autotp_size 2 on 2 ranks (one replica): the Trainer fills train_batch_size over
    all ranks (DeepSpeed's AutoTP count) and feeds both ranks the same batch; the same losses and
    consolidated weights as one process."""
    import torch
    from safetensors.torch import load_file

    one = _run(tmp_path, "one", None, "--save-model", str(tmp_path / "one_model"), nproc=1)
    tp = _run(
        tmp_path,
        "tp",
        dict(ZERO2, zero_optimization={"stage": 1}, tensor_parallel={"autotp_size": 2}),
        "--save-model",
        str(tmp_path / "tp_model"),
    )
    _assert_same_losses(_losses(tp), _losses(one))
    got, want = (
        load_file(str(tmp_path / "tp_model" / "model.safetensors")),
        load_file(str(tmp_path / "one_model" / "model.safetensors")),
    )
    assert set(got) == set(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-6, msg=k)


def test_config_is_a_read_only_mapping_and_accepts_inf():
    from zerotron.config import Config

    c = Config.load(
        {
            "train_micro_batch_size_per_gpu": 2,
            "gradient_accumulation_steps": 2,
            "steps_per_print": float("inf"),
            "zero_optimization": {"stage": 3},
        },
        world_size=2,
    )
    assert math.isinf(c.steps_per_print)
    assert c["train_batch_size"] == 8 and c.get("zero_optimization", {}).get("stage") == 3
    assert c.zero_optimization.stage == 3 and "optimizer" not in c and c.get("optimizer") is None
    c["zero_optimization"]["stage"] = 1  # a copy
    assert c["zero_optimization"]["stage"] == 3
    with pytest.raises(TypeError):
        c["train_batch_size"] = 1
    from zerotron.errors import ConfigError

    with pytest.raises(ConfigError):
        Config.load({"train_micro_batch_size_per_gpu": 2, "steps_per_print": 0.5})


def _norms(result):
    return [h["grad_norm"] for h in result["history"] if "grad_norm" in h]


@pytest.mark.parametrize(
    "name,config,extra", [("sp2_z2", ZERO2, ()), ("sp2_z3_offload_ckpt", ZERO3_OFFLOAD, ("--gradient-checkpointing",))]
)
def test_ulysses_through_parallelism_config_matches_one_process(tmp_path, name, config, extra):
    """ALST as the Transformers docs set it up (TrainingArguments(parallelism_config=
    ParallelismConfig(sp_backend="deepspeed", sp_size=2))): each sequence split over the 2 ranks;
    the ranks' batches taken in turn, the batches one process trains in the same order (its losses,
    gradient norms and eval loss: eval runs whole sequences, accelerate's sp_disable_in_eval)."""
    want = _run(tmp_path, "one", None, nproc=1)
    got = _run(tmp_path, name, config, "--sp", "2", *extra)
    assert got["sp"] == 2, got
    _assert_same_losses(_losses(got), _losses(want))
    assert all(_close(a, b) for a, b in zip(_norms(got), _norms(want))) and len(_norms(got)) == 6, (got, want)
    assert _close(got["eval"]["eval_loss"], want["eval"]["eval_loss"])


@pytest.mark.parametrize("stage", [2, 3])
def test_expert_parallel_mixtral_matches_ddp_and_saves_under_its_own_names(tmp_path, stage):
    """DeepSpeed's AutoEP section on a Transformers Mixtral (4 experts, top-2) over 2 ranks: each rank
    holds 2 experts, the Trainer's losses match DDP holding all 4, and save_model writes what DDP's does:
    every expert, under the names Transformers saves Mixtral with (its router `block_sparse_moe.gate`;
    DeepSpeed's AutoEP renames it `router.gate`), which Mixtral loads strictly."""
    import torch
    from safetensors.torch import load_file
    from transformers import MixtralForCausalLM

    ddp = _run(tmp_path, "ddp", None, "--moe", "--save-model", str(tmp_path / "ddp_model"))
    config = dict(ZERO2 if stage == 2 else ZERO3, expert_parallel={"enabled": True, "autoep_size": 2})
    if stage == 3:
        config["zero_optimization"] = dict(config["zero_optimization"], stage3_gather_16bit_weights_on_model_save=True)
    ep = _run(tmp_path, "ep", config, "--moe", "--save-model", str(tmp_path / "ep_model"))
    _assert_same_losses(_losses(ep), _losses(ddp))
    got, want = (load_file(str(tmp_path / m / "model.safetensors")) for m in ("ep_model", "ddp_model"))
    assert set(got) == set(want) and {"model.layers.1.block_sparse_moe.gate.weight",
                                       "model.layers.1.block_sparse_moe.experts.3.w2.weight"} <= set(got)  # fmt: skip
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-6, msg=k)
    MixtralForCausalLM.from_pretrained(tmp_path / "ep_model")  # (strict: every key found, none left over)
