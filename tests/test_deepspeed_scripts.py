"""Scripts written for DeepSpeed (examples/deepspeed/, in the style of its public tutorials) run
unchanged on 2 CPU ranks, both ways in: `zerotron run --as-deepspeed` with `import deepspeed`
untouched, and the one-line rename `import zerotron as deepspeed`. Where the math allows, their
losses match a single process training the same global batches."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples" / "deepspeed"


def _renamed(script: Path, tmp_path: Path) -> Path:
    """The script with its DeepSpeed imports renamed, as the README's first way in says."""
    text = re.sub(r"^import deepspeed$", "import zerotron as deepspeed", script.read_text(), flags=re.M)
    text = re.sub(r"^(from|import) deepspeed\.", r"\1 zerotron.", text, flags=re.M)
    assert "deepspeed." not in re.sub(
        r"deepspeed\.(initialize|init_distributed|add_config_arguments|zero|comm)",
        "",
        "\n".join(ln for ln in text.splitlines() if ln.startswith(("import", "from"))),
    )
    out = tmp_path / script.name
    out.write_text(text)
    return out


def _run(tmp_path, name: str, nproc: int, way: str, *args: str) -> list[float]:
    script = EXAMPLES / f"{name}.py"
    if way == "rename":
        script = _renamed(script, tmp_path)
    env = {
        k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "ZEROTRON_AS_DEEPSPEED")
    }
    env["OMP_NUM_THREADS"] = "1"
    command = [
        sys.executable,
        "-m",
        "zerotron.cli",
        "run",
        *(["--as-deepspeed"] if way == "alias" else []),
        "-n",
        str(nproc),
        str(script),
        "--deepspeed_config",
        str(EXAMPLES / f"{name}.json"),
        *args,
    ]
    out = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    if way == "rename":
        assert "import zerotron as deepspeed" in script.read_text()
    return [float(v) for v in re.findall(r"step \d+ loss ([0-9.]+)", out.stdout + out.stderr)]


def _close(a, b, rel=1e-5):
    return len(a) == len(b) > 0 and all(abs(x - y) <= rel * abs(y) for x, y in zip(a, b))


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "name,single_args",
    [("image_classifier", ()), ("pipeline_layers", ("--pipeline-parallel-size", "1")), ("sft_zero3", ())],
)
def test_tutorial_script_runs_unchanged_both_ways_and_matches_one_process(tmp_path, name, single_args):
    alias = _run(tmp_path, name, 2, "alias")
    renamed = _run(tmp_path, name, 2, "rename")
    single = _run(tmp_path, name, 1, "rename", *single_args)
    assert alias == renamed, (alias, renamed)  # the same code either way
    assert _close(alias, single), (alias, single)  # ZeRO / pipeline on 2 ranks = one process


@pytest.mark.timeout(600)
def test_bert_style_pretraining_resumes_on_the_uninterrupted_losses(tmp_path):
    straight = _run(tmp_path, "bert_pretraining", 2, "alias", "--output_dir", str(tmp_path / "a"), "--steps", "4")
    first = _run(tmp_path, "bert_pretraining", 2, "rename", "--output_dir", str(tmp_path / "b"), "--steps", "2")
    resumed = _run(
        tmp_path, "bert_pretraining", 2, "rename", "--output_dir", str(tmp_path / "b"), "--steps", "4", "--resume"
    )
    assert len(straight) == 4 and first == straight[:2]
    assert _close(resumed, straight[2:], rel=1e-6), (resumed, straight)
