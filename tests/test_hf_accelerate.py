"""accelerate on zerotron (ZEROTRON_AS_DEEPSPEED=1), against the same loop on plain DDP: a
DeepSpeedPlugin in the script (ZeRO-2, ZeRO-3) and `accelerate launch --use_deepspeed` (the plugin
from the launcher); losses, gradient norms, save_state/load_state, get_state_dict and save_pretrained."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("accelerate")
from distributed import free_port

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "hf_accelerate.py"
RTOL = 1e-5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import AutoModelForCausalLM, LlamaConfig

    path = tmp_path_factory.mktemp("model")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(
        LlamaConfig(
            vocab_size=96,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    ).save_pretrained(path)
    return path


def _run(mode: str, out: Path, model_dir: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_"))}
    env.update(ZEROTRON_AS_DEEPSPEED="0" if mode == "ddp" else "1", OMP_NUM_THREADS="1")
    if mode == "launch":  # as users start it: accelerate's launcher, ZeRO-3 and clipping from its flags
        cmd = [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--use_deepspeed",
            "--zero_stage",
            "3",
            "--zero3_save_16bit_model",
            "true",
            "--gradient_clipping",
            "1.0",
            "--gradient_accumulation_steps",
            "1",
            "--num_processes",
            "2",
            "--main_process_port",
            str(free_port()),
            str(SCRIPT),
            mode,
            str(out),
            str(model_dir),
        ]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(free_port()),
            str(SCRIPT),
            mode,
            str(out),
            str(model_dir),
        ]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(ln for ln in done.stdout.splitlines() if ln.startswith("RESULT "))
    return json.loads(line[len("RESULT ") :])


def _close(a, b):
    return len(a) == len(b) > 0 and all(abs(x - y) <= RTOL * abs(y) for x, y in zip(a, b))


@pytest.fixture(scope="module")
def ddp(tmp_path_factory, model_dir):
    out = tmp_path_factory.mktemp("ddp")
    return _run("ddp", out, model_dir), out


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode,stage", [("2", 2), ("3", 3), ("launch", 3)])
def test_accelerate_deepspeed_trains_saves_and_resumes_like_ddp(tmp_path, ddp, model_dir, mode, stage):
    from transformers import AutoModelForCausalLM

    (want, want_dir), got = ddp, _run(mode, tmp_path, model_dir)
    # zerotron's engine did the work (accelerate silently falls back to DDP when DeepSpeed is off)
    assert got["engine"] == "zerotron.engine.engine.Engine" and got["stage"] == stage, got
    assert want["type"] == "DistributedType.MULTI_CPU" and got["type"] == "DistributedType.DEEPSPEED"
    assert _close(got["first"] + got["after"], want["first"] + want["after"]), (got, want)
    assert _close(got["norms"], want["norms"]), (got["norms"], want["norms"])
    assert got["again"] == got["after"]  # load_state put back weights, optimizer and scheduler exactly
    ours, theirs = torch.load(tmp_path / "state_dict.pt"), torch.load(want_dir / "state_dict.pt")
    assert ours.keys() == theirs.keys() and len(ours) > 10
    worst = max((ours[k] - theirs[k]).abs().max().item() for k in ours)
    assert worst < 1e-5, worst
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    assert all(torch.equal(v.float(), ours[k]) for k, v in reloaded.state_dict().items() if k in ours)


@pytest.mark.timeout(300)
def test_accelerates_own_alst_script_trains_like_one_process():
    """accelerate's ALST test script itself (tools/public_alst_script.py: only the model and the CPU
    process group adapted), launched with ZeRO-3 on 2 ranks: each of its 4 samples split over both
    ranks, the losses it prints those of one process training the samples in order."""
    import re

    tool = Path(__file__).resolve().parents[1] / "tools" / "public_alst_script.py"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_"))}
    env.update(ZEROTRON_AS_DEEPSPEED="1", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(tool.parents[1]), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--use_deepspeed", "--zero_stage", "3"]
    cmd += ["--num_processes", "2", "--main_process_port", str(free_port()), str(tool)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    got = [float(x) for x in re.findall(r"\d+: loss=tensor\(([0-9.]+)", done.stdout)]

    from tools.public_alst_script import tiny_llama

    model = tiny_llama()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-5)
    want = []
    for i in range(4):  # the script's samples: ids 101.., positions counting on across samples, labels the ids
        ids = torch.arange(1 + 32 * i, 32 * (i + 1) + 1).view(1, -1) + 100
        loss = model(input_ids=ids, position_ids=torch.arange(32 * i, 32 * (i + 1)).view(1, -1), labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        want.append(loss.item())
    assert len(got) == 4 and all(abs(a - b) <= 1e-4 for a, b in zip(got, want)), (got, want)
