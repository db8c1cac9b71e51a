"""The two commands users run first: `zerotron train` and `zerotron run`."""

import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _zerotron(*args, timeout=240):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return subprocess.run(
        [sys.executable, "-m", "zerotron.cli", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_train_learns_on_two_processes():
    out = _zerotron(
        "train",
        "--model",
        "tiny",
        "--steps",
        "40",
        "--nproc",
        "2",
        "--seq-len",
        "64",
        "--eval-batches",
        "2",
        "--sample-bytes",
        "16",
        "--corpus-bytes",
        "300000",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(ln for ln in out.stdout.splitlines() if "validation loss" in ln)
    before, after = (float(v) for v in line.split("validation loss ")[1].split(" (")[0].split(" -> "))
    assert before > 5.0 and after < before - 1.0, line
    assert "2 x cpu (gloo)" in out.stdout and "sample:" in out.stdout


def test_train_with_zero3_partitioned_parameters(tmp_path):
    config = tmp_path / "z3.json"
    config.write_text(
        '{"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},'
        ' "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}'
    )
    out = _zerotron(
        "train",
        "--model",
        "tiny",
        "--steps",
        "20",
        "--nproc",
        "2",
        "--seq-len",
        "64",
        "--config",
        str(config),
        "--eval-batches",
        "2",
        "--sample-bytes",
        "16",
        "--corpus-bytes",
        "300000",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(ln for ln in out.stdout.splitlines() if "validation loss" in ln)
    before, after = (float(v) for v in line.split("validation loss ")[1].split(" (")[0].split(" -> "))
    assert after < before - 0.5, line


def test_train_with_tensor_and_sequence_parallelism():
    out = _zerotron(
        "train",
        "--model",
        "tiny",
        "--steps",
        "20",
        "--nproc",
        "2",
        "--tp",
        "2",
        "--sequence-parallel",
        "--tp-overlap",
        "--seq-len",
        "64",
        "--eval-batches",
        "2",
        "--sample-bytes",
        "16",
        "--corpus-bytes",
        "300000",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(ln for ln in out.stdout.splitlines() if "validation loss" in ln)
    before, after = (float(v) for v in line.split("validation loss ")[1].split(" (")[0].split(" -> "))
    assert after < before - 0.5, line


def test_train_a_mixture_of_experts_with_expert_parallelism():
    out = _zerotron(
        "train",
        "--model",
        "moe-tiny",
        "--ep",
        "2",
        "--zero",
        "2",
        "--steps",
        "20",
        "--nproc",
        "2",
        "--seq-len",
        "64",
        "--eval-batches",
        "2",
        "--sample-bytes",
        "16",
        "--corpus-bytes",
        "300000",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "moe-tiny GPT" in out.stdout and "dp 2 (experts over ep 2)" in out.stdout, out.stdout
    line = next(ln for ln in out.stdout.splitlines() if "validation loss" in ln)
    before, after = (float(v) for v in line.split("validation loss ")[1].split(" (")[0].split(" -> "))
    assert after < before - 1.0, line


def test_train_on_a_3d_mesh_of_eight_processes():
    out = _zerotron(
        "train",
        "--model",
        "tiny",
        "--steps",
        "20",
        "--dp",
        "2",
        "--tp",
        "2",
        "--pp",
        "2",
        "--grad-accum",
        "2",
        "--micro-batch",
        "4",
        "--seq-len",
        "64",
        "--eval-batches",
        "2",
        "--corpus-bytes",
        "300000",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "8 x cpu (gloo), dp 2 x tp 2 x pp 2" in out.stdout
    line = next(ln for ln in out.stdout.splitlines() if "validation loss" in ln)
    before, after = (float(v) for v in line.split("validation loss ")[1].split(" (")[0].split(" -> "))
    assert after < before - 0.5, line


def test_train_rejects_sizes_that_disagree():
    out = _zerotron("train", "--model", "tiny", "--steps", "1", "--dp", "2", "--pp", "2", "--nproc", "2")
    assert out.returncode != 0 and "disagrees with --dp x --cp x --sp x --tp x --pp = 4" in out.stderr


def test_train_saves_and_resumes_where_it_stopped(tmp_path):
    config = tmp_path / "constant_lr.json"  # the default schedule depends on --steps, which differs below
    config.write_text('{"train_micro_batch_size_per_gpu": 8, "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}}}')
    ckpt = tmp_path / "ck"
    common = (
        "train",
        "--model",
        "tiny",
        "--nproc",
        "2",
        "--seq-len",
        "32",
        "--eval-batches",
        "2",
        "--sample-bytes",
        "0",
        "--corpus-bytes",
        "300000",
        "--config",
        str(config),
    )
    straight = _zerotron(*common, "--steps", "8")
    first = _zerotron(*common, "--steps", "4", "--save-dir", str(ckpt))
    shutil.copytree(ckpt, tmp_path / "ck_tp")
    resumed = _zerotron(*common, "--steps", "8", "--save-dir", str(ckpt), "--resume", "--save-every", "2")
    # the data-parallel size halves (tensor parallelism over the same 2 processes), the accumulation
    # doubles: the same global batches from the same data position
    resumed_tp = _zerotron(
        *common, "--steps", "8", "--save-dir", str(tmp_path / "ck_tp"), "--resume", "--tp", "2", "--grad-accum", "2"
    )
    for out in (straight, first, resumed, resumed_tp):
        assert out.returncode == 0, out.stderr[-3000:]
    assert "resumed from" in resumed.stdout and "at step 4" in resumed.stdout

    def final(out):
        line = next(ln for ln in out.stdout.splitlines() if "validation loss" in ln)
        return line.split(" -> ")[1].split(" ")[0]

    assert final(resumed) == final(straight)  # same data order, same state: the same model

    # (validation differs: each data-parallel rank validates its share) the last step's loss, from the bar
    def last_loss(out):
        return re.findall(r"loss=([0-9.]+)", out.stderr)[-1]

    assert "dp 1 x tp 2" in resumed_tp.stdout and last_loss(resumed_tp) == last_loss(straight)
    assert sorted(p.name for p in ckpt.iterdir()) == ["global_step4", "global_step6", "global_step8", "latest"]


def test_run_launches_an_unchanged_deepspeed_script():
    out = _zerotron(
        "run",
        "-n",
        "2",
        "examples/deepspeed_script.py",
        "--steps",
        "12",
        "--deepspeed",
        "--deepspeed_config",
        "examples/ds_config.json",
    )
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("done:"))
    assert "12 steps" in line
    first, last = (float(v) for v in line.split("loss ")[1].split(" -> "))
    assert last < first


def test_bad_config_fails_before_training_with_the_key_named(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"train_micro_batch_size_per_gpu": 4, "gradient_clipping": -1}')
    out = _zerotron("train", "--model", "tiny", "--steps", "1", "--nproc", "1", "--config", str(bad))
    assert out.returncode != 0
    assert "gradient_clipping" in out.stderr


def test_hugging_face_example_fine_tunes_and_saves(tmp_path):
    out = _zerotron(
        "run",
        "-n",
        "2",
        "examples/hf_causal_lm.py",
        "--deepspeed_config",
        "examples/hf_ds_config.json",
        "--steps",
        "20",
        "--save",
        str(tmp_path / "hf"),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("done:"))
    first, last = (float(v) for v in line.split("loss ")[1].split(" -> "))
    assert "ZeRO-3" in line and last < first - 1.0, line
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tmp_path / "hf")  # a directory Transformers loads


def test_run_names_a_missing_script():
    out = _zerotron("run", "-n", "2", "no_such_script.py")
    assert out.returncode == 2 and "no such script" in out.stderr


# ---- an error zerotron raises in a launched job: its message once, no traceback ------------------------------
BAD_SCRIPT = """
import torch, zerotron
zerotron.initialize(model=torch.nn.Linear(4, 4), config={"train_micro_batch_size_per_gpu": 1,
                                                         "zero_optimization": {"stgae": 2}})
"""
TYPO = "config key 'zero_optimization.stgae' = 2: zero_optimization has no key 'stgae'; did you mean 'stage'?"


def test_a_config_error_in_a_launched_script_is_one_message(tmp_path):
    script = tmp_path / "bad.py"
    script.write_text(BAD_SCRIPT)
    out = _zerotron("run", "-n", "2", str(script))
    assert out.returncode == 1
    assert out.stderr.count(TYPO) == 1 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    debug = subprocess.run(
        [sys.executable, "-m", "zerotron.cli", "run", "-n", "2", str(script)],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1", "ZEROTRON_DEBUG": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert debug.returncode == 1 and "Traceback" in debug.stderr and "bad.py" in debug.stderr


def test_under_plain_torchrun_rank_0_prints_it_and_torchruns_table_names_it(tmp_path):
    script = tmp_path / "bad.py"
    script.write_text(BAD_SCRIPT)
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0
    assert 'bad.py", line' not in out.stderr, out.stderr  # no worker traceback
    assert sum(line.startswith(f"zerotron: {TYPO}") for line in out.stderr.splitlines()) == 1  # rank 0 printed it
    assert f"traceback : zerotron: {TYPO}" in out.stderr  # ... and in torchrun's root cause


def test_train_prints_a_worker_side_config_error_once():
    out = _zerotron("train", "--model", "tiny", "--tp", "3", "--steps", "1")
    assert out.returncode == 2
    assert out.stderr.strip() == (
        "zerotron: config key 'tensor_parallel.autotp_size' = 3: the model's attention "
        "heads (4) must be divisible by it; choose a size that divides it"
    ), out.stderr


def test_train_names_more_pipeline_stages_than_layers_before_launching():
    out = _zerotron("train", "--model", "tiny", "--pp", "4", "--steps", "1")
    assert out.returncode == 1 and out.stderr.strip() == (
        "--pp 4: the tiny GPT has 2 layers and each pipeline stage needs at least one; use at most 2 stages in all, "
        "or a larger --model"
    ), out.stderr


@pytest.mark.parametrize("flag,fits", [("--sp", "62"), ("--cp", "60")])  # Ulysses; ring attention (halves)
def test_train_with_sequence_parallelism(flag, fits):
    out = _zerotron(
        "train", "--model", "tiny", "--steps", "30", flag, "2", "--seq-len", "64", "--eval-batches", "2",
        "--corpus-bytes", "300000",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(ln for ln in out.stdout.splitlines() if "validation loss" in ln)
    before, after = (float(v) for v in line.split("validation loss ")[1].split(" (")[0].split(" -> "))
    assert f"dp 1 x {flag[2:]} 2 x tp 1" in out.stdout and after < before - 1.0, out.stdout
    assert "sample: skipped" in out.stdout
    odd = _zerotron("train", "--model", "tiny", flag, "2", "--seq-len", "63", timeout=60)
    assert odd.returncode != 0 and f"--seq-len {fits}" in odd.stderr + odd.stdout
