"""A DeepSpeed run migrates to zerotron and back: engine.load_checkpoint on directories DeepSpeed 0.19.8 wrote
(ZeRO 0-3, fp32 and bf16, native and universal; tests/deepspeed_checkpoints/, written by
tools/deepspeed_checkpoints.py with DeepSpeed's own resumed losses), `zerotron convert --from-deepspeed` /
`--to-deepspeed`, zero_to_fp32 on DeepSpeed's layout, and the restricted unpickler."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from distributed import run_ranks
from safetensors.torch import load_file

import zerotron
from tools import deepspeed_checkpoints as ds
from zerotron.checkpoint import CheckpointError
from zerotron.checkpoint.deepspeed_pickle import load as load_deepspeed_file
from zerotron.checkpoint.load import open_checkpoint
from zerotron.cli import main
from zerotron.compat.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

GOLDEN = json.loads((ds.FIXTURES / "golden.json").read_text())
TOLERANCE = 1e-6  # DeepSpeed's resumed losses against zerotron's


def _ckpt(case: str) -> str:
    return str(ds.FIXTURES / case / "ckpt")


def _resume(runs):
    """For each (directory, ZeRO stage, dtype, optimizer states?): zerotron resumes it and trains
    RESUME_STEPS; the losses (per step, every rank's), the lr after loading, counters, client state."""
    out = []
    for directory, stage, dtype, states in runs:
        engine, *_ = zerotron.initialize(model=ds.make_model(7), config=ds.config(stage, dtype, world=_world()))
        _, client = engine.load_checkpoint(directory, load_optimizer_states=states)
        lr = engine.optimizer.param_groups[0]["lr"]
        losses = ds.train(engine, ds.RESUME_STEPS)
        out.append((losses, lr, engine.global_steps, {k: client.get(k) for k in ds.CLIENT_STATE}))
    return out


def _world():
    import torch.distributed as dist

    return dist.get_world_size()


def _assert_like_deepspeed(losses, golden, mean=False):
    want = [[sum(step) / len(step)] if mean else step for step in golden["losses"]]
    diff = max(abs(a - b) for got_step, want_step in zip(losses, want) for a, b in zip(got_step, want_step))
    assert diff <= TOLERANCE, f"losses {losses} vs DeepSpeed's resume {want}: {diff:.2e} apart"
    return diff


def test_resumes_every_deepspeed_checkpoint_as_deepspeed_does():
    """Every stage and dtype at the world size DeepSpeed saved with, and at another ZeRO stage (a ZeRO-1
    directory into ZeRO-3 and back, stage 0 into 2); then the optimizer's moments left out, which must show."""
    runs = [(_ckpt(ds.case_name(s, d)), s, d, True) for s, d in ds.CASES]
    runs += [(_ckpt("zero1_fp32"), 3, "fp32", True), (_ckpt("zero3_bf16"), 1, "bf16", True)]
    runs += [(_ckpt("zero0_fp32"), 2, "fp32", True), (_ckpt("zero2_fp32"), 2, "fp32", False)]
    results = run_ranks(_resume, 2, runs, timeout=120)[0]
    for (directory, stage, dtype, states), (losses, lr, steps, client) in zip(runs, results):
        golden = GOLDEN[Path(directory).parent.name]["resumed"]
        if not states:  # the negative control: fresh moments give visibly other losses
            assert abs(losses[1][0] - golden["losses"][1][0]) > 1e-3, (losses, golden["losses"])
            continue
        _assert_like_deepspeed(losses, golden)
        assert lr == pytest.approx(golden["lr"], abs=1e-12)  # the scheduler, at DeepSpeed's step
        assert steps == golden["global_steps"] + ds.RESUME_STEPS
        assert client == golden["client_state"] == ds.CLIENT_STATE


def test_resumes_deepspeed_checkpoints_on_another_world_size():
    """fp32 native checkpoints on one rank (the global batch's loss is the ranks' mean), and the universal
    ones on two ranks and on one, where DeepSpeed resumed them too (bf16 on one rank: DeepSpeed's own
    one-rank resume is the reference, the two-rank mean is not: bf16 gradients sum in another order)."""
    runs = [(_ckpt(ds.case_name(s, "fp32")), s, "fp32", True) for s in (0, 2, 3)]
    runs += [(_ckpt("universal_" + ds.case_name(s, d)), s, d, True) for s, d in ds.UNIVERSAL]
    one = run_ranks(_resume, 1, runs, timeout=120)[0]
    for (directory, *_), (losses, _, steps, client) in zip(runs, one):
        golden = GOLDEN[Path(directory).parent.name]
        if "resumed_world1" in golden:
            _assert_like_deepspeed(losses, golden["resumed_world1"])
        else:
            _assert_like_deepspeed(losses, golden["resumed"], mean=True)
        assert client == ds.CLIENT_STATE
    universal = runs[3:]
    two = run_ranks(_resume, 2, universal, timeout=120)[0]
    for (directory, *_), (losses, *_) in zip(universal, two):
        _assert_like_deepspeed(losses, GOLDEN[Path(directory).parent.name]["resumed"])


@pytest.mark.parametrize("case", [ds.case_name(s, d) for s, d in ds.CASES if s > 0])
def test_zero_to_fp32_gives_deepspeeds_weights(case):
    """zero_to_fp32 on DeepSpeed's directory gives what DeepSpeed's own zero_to_fp32 gave, bit for bit."""
    want = load_file(str(ds.FIXTURES / case / "zero_to_fp32.safetensors"))
    got = get_fp32_state_dict_from_zero_checkpoint(_ckpt(case))
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


class _NotAllowed:
    def __reduce__(self):
        return (shutil.rmtree, ("/nonexistent-directory",))


def test_the_unpickler_refuses_other_classes(tmp_path):
    path = tmp_path / "mp_rank_00_model_states.pt"
    torch.save({"module": {}, "payload": _NotAllowed()}, path)
    with pytest.raises(CheckpointError, match=r"shutil\.rmtree"):
        load_deepspeed_file(path)
    with pytest.raises(CheckpointError, match=r"shutil\.rmtree"):  # and through the loader's detection
        open_checkpoint(tmp_path)
    stage = load_deepspeed_file(ds.FIXTURES / "zero3_fp32/ckpt/global_step3/zero_pp_rank_0_mp_rank_00_optim_states.pt")
    assert stage["optimizer_state_dict"]["zero_stage"] == 3  # DeepSpeed's ZeroStageEnum, without DeepSpeed


def test_a_directory_that_is_neither_says_so(tmp_path):
    (tmp_path / "global_step1").mkdir()
    with pytest.raises(CheckpointError, match="meta.json is missing"):
        open_checkpoint(tmp_path / "global_step1")


def _save_zerotron(source, stage, dtype, out):
    """zerotron resumes DeepSpeed's `source` at ZeRO `stage` and saves its own checkpoint to `out`."""
    engine, *_ = zerotron.initialize(model=ds.make_model(7), config=ds.config(stage, dtype, world=_world()))
    engine.load_checkpoint(source)
    engine.save_checkpoint(out, client_state=ds.CLIENT_STATE)


def test_convert_from_deepspeed_gives_a_checkpoint_that_resumes_the_same(tmp_path):
    out = tmp_path / "zt"
    assert main(["convert", "--from-deepspeed", _ckpt("zero2_bf16"), str(out)]) == 0
    meta = json.loads((out / "global_step3" / "meta.json").read_text())
    assert meta["format"] == "zerotron-checkpoint" and meta["client_state"] == ds.CLIENT_STATE
    assert meta["param_order"] == [n for n, _ in ds.make_model().named_parameters()]
    ((losses, lr, steps, client),) = run_ranks(_resume, 2, [(str(out), 3, "bf16", True)], timeout=60)[0]
    _assert_like_deepspeed(losses, GOLDEN["zero2_bf16"]["resumed"])
    assert (lr, steps, client) == (GOLDEN["zero2_bf16"]["resumed"]["lr"], 3 + ds.RESUME_STEPS, ds.CLIENT_STATE)


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_convert_to_deepspeed_round_trips(tmp_path, stage):
    """A zerotron checkpoint (ZeRO-1 bf16, whose flat buffers hold the parameters in reverse) written in
    DeepSpeed's layout reads back as the same tensors, in the model's order, and resumes as DeepSpeed's
    own directory did. (Real DeepSpeed 0.19.8 resumed such directories with DeepSpeed's own losses:
    tools/deepspeed_checkpoints.py resume; docs/deepspeed.md.)"""
    zt, out = tmp_path / "zt", tmp_path / "ds"
    run_ranks(_save_zerotron, 2, _ckpt("zero1_bf16"), 1, "bf16", str(zt), timeout=60)
    args = ["convert", "--to-deepspeed", str(zt), str(out), "--zero-stage", str(stage), "--world-size", "2"]
    assert main(args) == 0
    back, original = open_checkpoint(out / "global_step3"), open_checkpoint(zt / "global_step3")
    assert back.names() == [n for n, _ in ds.make_model().named_parameters()] == original.names()
    for name in back.names():
        for kind in ["master"] + [f"state.{k}" for k in original.state_keys(name)]:
            assert torch.equal(back.full(name, kind), original.full(name, kind)), (name, kind)
    assert back.scalars == original.scalars and back.meta["lr_scheduler"] == original.meta["lr_scheduler"]
    ((losses, *_),) = run_ranks(_resume, 2, [(str(out), 2, "bf16", True)], timeout=60)[0]
    _assert_like_deepspeed(losses, GOLDEN["zero1_bf16"]["resumed"])


def test_convert_refuses_what_it_cannot_write(tmp_path, capsys):
    assert main(["convert", "--to-deepspeed", _ckpt("zero2_fp32"), str(tmp_path), "--dtype", "fp16"]) == 2
    assert "fp16 is not written" in capsys.readouterr().err
    assert main(["convert", "--from-deepspeed", "--to-deepspeed", _ckpt("zero2_fp32"), str(tmp_path)]) == 2
