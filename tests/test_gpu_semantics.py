"""What NCCL and GPUs demand that gloo on a CPU forgives, checked on the CPU: strict communication
(one work per point-to-point batch, outputs valid only after wait(), no host tensors in
collectives, asynchronous completion seen by the watchdog), timeouts, the order of operations across
communicators. (Host syncs per step: tests/test_fake_cuda.py, on a fake GPU.)"""

import datetime
import os
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
from distributed import RankError, run_ranks
from parity import ds_config, global_batches, make_model, micro_batches

import zerotron

STRICT = {"ZEROTRON_STRICT_COMM": "1"}


def test_the_suite_runs_under_strict_communication():
    assert os.environ.get("ZEROTRON_STRICT_COMM") == "1"  # set in conftest.py, so every test runs under it


# ---- strict mode itself --------------------------------------------------------------------------
def _stale_read():
    from zerotron.comm import Comm

    comm = Comm(None, "world")
    x = torch.full((4,), float(dist.get_rank() + 1))
    work = comm.all_reduce(x, async_op=True)
    before = x.clone()  # read before wait(): what NCCL gives is not the result yet
    work.wait()
    return before.tolist(), x.tolist()


def test_an_async_output_is_written_only_at_wait():
    (before, after), _ = run_ranks(_stale_read, 2)
    assert before == [1.0] * 4 and after == [3.0] * 4


def _batch_is_one_work():
    from zerotron.comm import Comm

    comm = Comm(None, "world")
    other = 1 - dist.get_rank()
    out, got = torch.full((3,), float(dist.get_rank())), torch.zeros(3)
    work = comm.batch_p2p([dist.P2POp(dist.isend, out, other), dist.P2POp(dist.irecv, got, other)])
    stale = got.tolist()
    work.wait()
    return type(work).__name__, stale, got.tolist()


def test_a_point_to_point_batch_is_one_work_and_its_receives_land_at_wait():
    results = run_ranks(_batch_is_one_work, 2)
    assert results[0] == ("Work", [0.0] * 3, [1.0] * 3)
    assert results[1] == ("Work", [0.0] * 3, [0.0] * 3)


def _host_tensor_in_a_collective():
    from zerotron.comm import Comm
    from zerotron.zero.offload import host_empty

    buffer = host_empty(8, torch.float32, pin=False)
    derived = buffer[:4].square().sum()  # computed from host memory: still host memory
    Comm(None, "world").all_reduce(derived)


def test_a_host_tensor_in_a_collective_is_named():
    with pytest.raises(RankError, match=r"all_reduce\(SUM\) on group world of a float32\[\] tensor in host memory"):
        run_ranks(_host_tensor_in_a_collective, 2)


def _offload_with_clipping(stage):
    config = ds_config(2, 1, clip=0.5, zero_optimization={"stage": stage, "offload_optimizer": {"device": "cpu"}})
    engine, *_ = zerotron.initialize(model=make_model(), config=config)
    for b in global_batches(2, 4):
        engine.train_batch(iter(micro_batches(b, engine.coords.dp, 2, 1)))
    return engine.get_global_grad_norm()


@pytest.mark.parametrize("stage", [1, 3])
def test_offload_with_gradient_clipping_reduces_its_norm_on_the_device(stage):
    norms = run_ranks(_offload_with_clipping, 2, stage)
    assert norms[0] == norms[1] and norms[0] > 0


# ---- host syncs: counted under CUDA's rules for every feature by tests/test_fake_cuda.py --------------------


# ---- timeouts ---------------------------------------------------------------------------------------
_STALLED = """
import datetime, os, sys, time, torch, torch.distributed as dist, zerotron
sys.path.insert(0, {tests!r})
from parity import ds_config, make_model
zerotron.init_distributed(timeout=datetime.timedelta(seconds=6))
engine, *_ = zerotron.initialize(model=make_model(), config=ds_config(2, 1))
if dist.get_rank() == 1:
    time.sleep(120)  # a stalled rank: the other waits in the step's collective
x, y = torch.randint(0, 256, (2, 16)), torch.randint(0, 256, (2, 16))
engine.train_batch(iter([(x, y)]))
"""


def test_init_distributed_timeout_bounds_a_stalled_collective(tmp_path):
    script = tmp_path / "stall.py"
    script.write_text(_STALLED.format(tests=os.path.dirname(__file__)))
    start = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-m", "zerotron.cli", "run", "-n", "2", str(script)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    took = time.monotonic() - start
    assert out.returncode != 0
    assert "collective timeout" in out.stderr and "timeout 6 s" in out.stderr, out.stderr[-2000:]
    assert took < 60, took  # the 6 s timeout, its report and the launcher's teardown; not 30 minutes


def _group_timeouts():
    zerotron.init_distributed(timeout=datetime.timedelta(seconds=42))
    from zerotron.comm import group_timeout
    from zerotron.topology import Topology

    topo = Topology(dist.get_world_size(), tp=2).build_groups()
    from zerotron import watchdog

    return group_timeout().total_seconds(), watchdog.get().timeout_s, topo.group("tp") is not None


def test_every_group_and_the_watchdog_take_init_distributeds_timeout():
    group, watch, built = run_ranks(_group_timeouts, 2)[0]
    assert watch == 42 and group == 52 and built  # the backend's timeout is the watchdog's backstop


# ---- the order of operations across communicators ---------------------------------------------------
def _issue_order(stage, gas, steps=3):
    """Every operation this rank issues through zerotron's Comm, in order: (group, operation)."""
    from zerotron.comm import core

    order = []
    issue = core.Comm._issue  # (point-to-point batches go through it too)
    core.Comm._issue = lambda self, op, *a, **k: (
        order.append((self.name, tuple(self.ranks), op)),
        issue(self, op, *a, **k),
    )[1]
    zero = {
        "stage": stage,
        "reduce_bucket_size": 20_000,
        "stage3_param_persistence_threshold": 0,
        "stage3_prefetch_bucket_size": 2,
    }
    engine, *_ = zerotron.initialize(model=make_model(n_kv_head=4), config=ds_config(1, gas, zero_optimization=zero))
    for b in global_batches(steps, gas * 2):
        engine.train_batch(iter(micro_batches(b, engine.coords.dp, 2, gas)))
    return order


@pytest.mark.parametrize("stage,gas", [(0, 2), (1, 1), (2, 2), (3, 2)])
def test_every_rank_issues_its_operations_on_world_dp_and_dp_grad_in_one_order(stage, gas):
    """NCCL runs each communicator on its own stream, and two ranks that issue operations on two
    communicators in opposite orders can deadlock. Bucket reductions start from gradient hooks and
    ZeRO-3 gathers from forward/backward hooks, interleaved with the step's collectives on other
    groups; autograd runs the same graph in the same order on every rank, so the order is the same:
    checked here over several groups (world, dp, dp_grad, the norm's) and steps."""
    first, second = run_ranks(_issue_order, 2, stage, gas)
    assert first == second
    assert len({group for group, _, _ in first}) >= 3 and len(first) > 20
