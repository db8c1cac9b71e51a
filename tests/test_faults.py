"""When a running job goes wrong: hangs and diverging ranks become messages, NaN steps are skipped, bad
input is named, finished jobs exit 0. Jobs run as real `zerotron run` / `zerotron train` processes.
(Preemption and killed ranks: test_faults_restart.py.)"""

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from distributed import run_ranks
from faults.soak import env  # the soak test's launcher environment
from parity import ds_config, make_model

import zerotron

ROOT = Path(__file__).resolve().parent.parent

# A 2-rank job on the tiny GPT: rank 1 skips step `SKIP` (a branch taken on one rank only).
DIVERGING_JOB = """
import sys, torch, torch.distributed as dist, zerotron
sys.path.insert(0, {tests!r})
from parity import ds_config, make_model
zerotron.init_distributed()
engine, *_ = zerotron.initialize(model=make_model(), config=ds_config(
    2, 1, zerotron={{"collective_timeout": 3, "collective_checks": {checks}}}))
x = torch.randint(0, 256, (2, 16))
for step in range(4):
    if step == 1 and dist.get_rank() == 1:
        continue
    engine.backward(engine(x, x))
    engine.step()
dist.barrier()
"""


def _run_job(tmp_path, source: str, *args, timeout=120):
    script = tmp_path / "job.py"
    script.write_text(source)
    start = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "zerotron.cli", "run", "-n", "2", *args, str(script)],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return out, time.monotonic() - start


def test_a_rank_that_skips_a_collective_stops_the_job_with_a_message(tmp_path):
    out, seconds = _run_job(tmp_path, DIVERGING_JOB.format(tests=str(ROOT / "tests"), checks=False))
    assert out.returncode == 70, out.stderr[-3000:]  # EXIT_FAULT, from the launcher
    assert seconds < 60
    err = out.stderr
    assert "collective timeout at step" in err and "waited" in err and "(timeout 3 s)" in err
    assert "not arrived: ranks [" in err and "last finished per group" in err  # who was where
    assert "group dp_grad" in err or "group world" in err


def _mismatched_calls():
    from zerotron.comm import Comm

    zerotron.watchdog.configure(timeout_s=10, checks=True)
    comm, t = Comm(None, "world"), torch.ones(8)
    comm.all_reduce(t)
    try:
        comm.all_reduce(t) if comm.rank == 0 else comm.broadcast(t)  # rank 1 took another branch
    except zerotron.CollectiveMismatch as e:
        return str(e)


def test_collective_checks_name_the_first_divergence():
    for message in run_ranks(_mismatched_calls, 2):
        assert "collective #2 on group world[0, 1]" in message
        assert (
            "calls all_reduce(SUM) float32[8] at step 0" in message and "calls broadcast(from 0) float32[8]" in message
        )


BRANCH_JOB = """
import sys, torch, torch.distributed as dist, zerotron
sys.path.insert(0, {tests!r})
from parity import ds_config, make_model
zerotron.init_distributed()
engine, *_ = zerotron.initialize(model=make_model(), config=ds_config(
    2, 1, zerotron={{"collective_timeout": 3, "collective_checks": True}}))
x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(dist.get_rank()))
for step in range(3):
    loss = engine(x, x)
    if step == 1 and dist.get_rank() == 1:  # a decision on a rank-local value: only rank 1 saves
        engine.save_checkpoint({save!r})
    engine.backward(loss)
    engine.step()
"""


def test_collective_checks_name_a_rank_that_took_another_branch(tmp_path):
    out, seconds = _run_job(tmp_path, BRANCH_JOB.format(tests=str(ROOT / "tests"), save=str(tmp_path / "c")))
    assert out.returncode == 70 and seconds < 60, out.stderr[-3000:]
    assert "never called collective" in out.stderr and "at step 1" in out.stderr
    err = out.stderr  # whichever rank reports first names both branches' collectives
    # (save_checkpoint's first collective: the ranks agree on the directory and tag)
    assert "calls all_gather_object at step 1" in err or "in all_gather_object #2 on group world" in err
    # (the model's 10 gradient buckets: rank 0 waits in step 1's first reduction, #11)
    assert "calls all_reduce(SUM) float32" in err or re.search(r"in all_reduce\(SUM\) #\d+ on group dp_grad", err)


# ---- NaN / Inf ------------------------------------------------------------------------------------
def _nan_run(precision, stage, nan_steps, limit):
    """Train 6 steps; rank 1's logits become NaN at `nan_steps`. Returns what each step did."""
    torch.manual_seed(0)
    model = make_model()
    engine, *_ = zerotron.initialize(
        model=model,
        config=ds_config(
            2,
            1,
            zero_optimization={"stage": stage},
            bf16={"enabled": precision == "bf16"},
            zerotron={"max_nonfinite_steps": limit},
        ),
    )
    rank = torch.distributed.get_rank()
    step_box = [0]
    engine.module.lm_head.register_forward_hook(
        lambda m, i, out: out * float("nan") if rank == 1 and step_box[0] in nan_steps else out
    )
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(rank))
    changed = []
    try:
        for step in range(6):
            step_box[0] = step
            before = [p.detach().clone() for p in engine.module.parameters()]
            engine.backward(engine(x, x))
            engine.step()
            changed.append(any(not torch.equal(b, p) for b, p in zip(before, engine.module.parameters())))
    except zerotron.NonFiniteError as e:
        return changed, engine.skipped_steps, str(e)
    finite = all(torch.isfinite(p).all() for p in engine.module.parameters())
    return changed, engine.skipped_steps, finite


@pytest.mark.parametrize("precision,stage", [("fp32", 0), ("bf16", 2)])
def test_a_nan_on_one_rank_skips_that_step_on_every_rank(precision, stage):
    for changed, skipped, finite in run_ranks(_nan_run, 2, precision, stage, (2,), 3):
        assert changed == [True, True, False, True, True, True]  # step 2 left the weights alone, everywhere
        assert skipped == 1 and finite is True


def test_a_streak_of_nan_steps_stops_training():
    for changed, skipped, message in run_ranks(_nan_run, 2, "fp32", 1, (1, 2, 3, 4), 3):
        assert changed == [True, False, False]  # the third bad step in a row raises, on both ranks
        assert "3 consecutive steps had NaN/Inf values" in message and "NaN/Inf loss on rank(s) [1]" in message


# ---- bad input ------------------------------------------------------------------------------------
BAD_TOKENS_JOB = """
import sys, torch, torch.distributed as dist, zerotron
sys.path.insert(0, {tests!r})
from parity import ds_config, make_model
zerotron.init_distributed()
engine, *_ = zerotron.initialize(model=make_model(), config=ds_config(2, 1))
x = torch.randint(0, 256, (2, 16))
if dist.get_rank() == 1:
    x[1, 3] = 300
engine.backward(engine(x, x))
engine.step()
"""


def test_out_of_vocabulary_tokens_stop_the_job_with_their_name(tmp_path):
    out, seconds = _run_job(tmp_path, BAD_TOKENS_JOB.format(tests=str(ROOT / "tests")))
    assert out.returncode != 0 and seconds < 60
    assert "zerotron: bad input at step 0: token id 300 on rank(s) [1] is outside the vocabulary [0, 256)" in out.stderr


def _bad_token_on_rank_1():
    import torch.distributed as dist

    engine, *_ = zerotron.initialize(model=make_model(), config=ds_config(2, 1))
    x = torch.randint(0, 256, (2, 16))
    if dist.get_rank() == 1:
        x[1, 3] = 300
    before = [p.detach().clone() for p in engine.module.parameters()]
    engine.backward(engine(x, x))  # no host sync here: the ids are checked at the step
    try:
        engine.step()
    except zerotron.BadBatchError as e:
        untouched = all(torch.equal(a, p) for a, p in zip(before, engine.module.parameters()))
        return str(e), untouched
    return None, None


def test_out_of_vocabulary_tokens_are_named_on_every_rank_before_the_update():
    for message, untouched in run_ranks(_bad_token_on_rank_1, 2):
        assert message == (
            "bad input at step 0: token id 300 on rank(s) [1] is outside the vocabulary [0, 256): "
            "check the tokenizer against the model's vocab_size (the step was not applied)"
        )
        assert untouched


def test_bad_batches_and_data_are_named_before_anything_runs():
    engine, *_ = zerotron.initialize(model=make_model(), config=ds_config(2, 1))
    with pytest.raises(zerotron.BadBatchError, match="empty batch"):
        engine(torch.empty(0, 16, dtype=torch.long), torch.empty(0, 16, dtype=torch.long))
    with pytest.raises(zerotron.BadBatchError, match="token id -1 is outside the vocabulary"), torch.no_grad():
        engine(torch.full((2, 16), -1), torch.zeros(2, 16, dtype=torch.long))  # evaluation: named at once
    with pytest.raises(ValueError, match="fewer than one global batch"):
        zerotron.initialize(model=make_model(), config=ds_config(4, 1), training_data=[torch.zeros(16)] * 3)
    ragged = [(torch.zeros(n, dtype=torch.long), torch.zeros(n, dtype=torch.long)) for n in (16, 12, 14, 10)]
    engine, _, loader, _ = zerotron.initialize(model=make_model(), config=ds_config(2, 1), training_data=ragged)
    with pytest.raises(zerotron.BadBatchError, match="samples of different shapes"):
        for _ in range(2):
            next(iter(loader))


def test_train_names_a_missing_config_and_too_little_data(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "zerotron.cli", "train", "--config", str(tmp_path / "none.json")],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "none.json': no such file" in out.stderr
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "zerotron.cli",
            "train",
            "--model",
            "tiny",
            "--nproc",
            "1",
            "--corpus-bytes",
            "300",
            "--seq-len",
            "128",
            "--steps",
            "1",
        ],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0 and "fewer than one global batch (8)" in out.stderr


_EXIT_CHECK = """
import atexit, torch.distributed as dist
from zerotron.watchdog import Watchdog
dog = None
atexit.register(lambda: print("watchdog thread alive at exit:", dog._thread.is_alive()))  # runs after dog.stop
dog = Watchdog(dist.HashStore(), rank=0, world=2, timeout_s=60)
"""


def test_the_watchdog_thread_stops_before_the_interpreter_finalizes():
    # A daemon thread left inside a store call while Python finalizes aborts the finished job with
    # SIGABRT ("terminate called without an active exception"): about 1 run in 10 before this.
    out = subprocess.run([sys.executable, "-c", _EXIT_CHECK], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "watchdog thread alive at exit: False" in out.stdout


@pytest.mark.timeout(900)
def test_finished_jobs_exit_zero():
    # tests/faults/exits.py, short: the 3D and ZeRO-2 bf16 runs that used to abort at teardown now and then
    # (one 3D run here: test_cli.py's 3D job is the suite's second, its exit status checked the same way)
    from faults.exits import soak

    counts = soak({"3d-8-ranks": 1, "zero2-bf16-2-ranks": 3}, log=lambda *a: None)
    assert counts == {"3d-8-ranks": {0: 1}, "zero2-bf16-2-ranks": {0: 3}}, counts
