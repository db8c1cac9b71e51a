"""The planner's search and its command: valid layouts ranked by speed, the plan's config that trains, a
table with no two rows alike, and what it says when matplotlib is missing or nothing fits."""

import pytest

from zerotron.planner import ModelShape


# ---- the search and the command ------------------------------------------------------------------------
def test_search_yields_only_valid_layouts_ranked_by_speed():
    from zerotron.config import Config
    from zerotron.planner import hardware
    from zerotron.planner.search import deepspeed_config, plan

    shape = ModelShape.parse("llama2-13b")
    hw = hardware.hardware("a100-40")
    candidates = plan(shape, 32, hw, 4096, 256)
    fitting = [c for c in candidates if c.rejected is None]
    assert fitting and len(fitting) < len(candidates)  # at 13B on 40 GB some layouts cannot fit
    speeds = [c.tokens_per_s for c in fitting]
    assert speeds == sorted(speeds, reverse=True)
    for c in candidates:
        L = c.layout
        assert L.dp * L.tp * L.pp == 32 and L.dp * L.micro_batch * L.grad_accum == 256
        assert shape.heads % L.tp == 0 and L.tp <= hw.gpus_per_node and not (L.pp > 1 and L.zero == 3)
        assert (c.rejected is None) == (
            c.memory["total"] <= (hw.memory_gib - hw.reserve_gib) * 2**30
            and c.memory["host"] * 8 <= hw.host_gib * 2**30 * 0.9
        )
    assert any(c.layout.zero == 0 and "GiB per GPU" in c.rejected for c in candidates if c.rejected)
    for c in fitting[:20]:  # the configs it writes are ones the engine accepts
        cfg = Config.load(deepspeed_config(c.layout, 256), world_size=32, pipeline_stages=c.layout.pp)
        assert cfg.train_batch_size == 256 and cfg.zero_optimization.stage == c.layout.zero


def test_plan_command_writes_a_config_that_trains(tmp_path):
    import json
    import subprocess
    import sys

    out, png = tmp_path / "plan.json", tmp_path / "plan.png"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "zerotron.cli",
            "plan",
            "--model",
            "tiny",
            "--gpus",
            "2",
            "--hardware",
            "cpu",
            "--seq",
            "64",
            "--global-batch",
            "8",
            "--precision",
            "fp32",
            "--out",
            str(out),
            "--plot",
            str(png),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert "tokens/s" in run.stdout and png.stat().st_size > 10_000
    config = json.loads(out.read_text())
    train = subprocess.run(
        [
            sys.executable,
            "-m",
            "zerotron.cli",
            "train",
            "--model",
            "tiny",
            "--config",
            str(out),
            "--seq-len",
            "64",
            "--steps",
            "2",
            "--eval-batches",
            "1",
            "--sample-bytes",
            "0",
            "--corpus-bytes",
            "20000",
            "--nproc",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
    )
    assert train.returncode == 0, train.stderr[-3000:]
    assert "model states: predicted" in train.stderr  # the engine's start-up prediction next to the measurement
    assert config["train_batch_size"] == 8


@pytest.mark.parametrize("model,gpus,batch", [("125m", 1, 8), ("1.3b", 8, 64)])
def test_a_plan_lists_no_two_layouts_a_user_cannot_tell_apart(model, gpus, batch):
    """At one data-parallel rank, ZeRO-2 shards gradients over one rank (ZeRO-1) and there is nothing
    to overlap a parameter gather with: such rows would repeat others, memory and speed alike."""
    from collections import Counter

    from zerotron.planner import hardware
    from zerotron.planner.search import plan

    candidates = plan(ModelShape.parse(model), gpus, hardware.hardware("h100"), 4096, batch)

    def shown(c):  # what a row of the table says, but the ZeRO stage and its options
        L = c.layout
        return (
            round(c.memory["total"] / 2**20),
            round(c.memory.get("host", 0) / 2**20),
            round(c.tokens_per_s),
            L.dp,
            L.tp,
            L.pp,
            L.micro_batch,
            L.checkpoint,
            L.offload,
            L.schedule,
            L.chunks,
        )

    repeated = [k for k, n in Counter(map(shown, candidates)).items() if n > 1]
    assert not repeated, [c.layout.describe() for c in candidates if shown(c) == repeated[0]]


def test_plot_without_matplotlib_is_refused_before_the_plan_is_written(tmp_path, monkeypatch, capsys):
    import sys

    from zerotron.cli import main

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    out = tmp_path / "p.json"
    code = main(
        [
            "plan",
            "--model",
            "125m",
            "--gpus",
            "1",
            "--global-batch",
            "8",
            "--out",
            str(out),
            "--plot",
            str(tmp_path / "p.png"),
        ]
    )
    assert code == 2 and not out.exists()
    assert "pip install 'zerotron[plot]'" in capsys.readouterr().err


def test_plan_command_says_when_nothing_fits(tmp_path):
    import subprocess
    import sys

    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "zerotron.cli",
            "plan",
            "--model",
            "llama3-70b",
            "--gpus",
            "2",
            "--hardware",
            "a100-40",
            "--seq",
            "4096",
            "--global-batch",
            "8",
            "--no-offload",
            "--out",
            str(tmp_path / "p.json"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 3 and "nothing fits" in run.stdout and "needs" in run.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "zerotron.cli", "plan", "--model", "nonsense", "--gpus", "2", "--global-batch", "8"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "unknown model" in bad.stderr
