"""DeepSpeed's `deepspeed.comm` functions through zerotron.comm, as scripts call them: the names, the
keywords, and the values of the collectives, point-to-point calls and groups on two ranks."""

import datetime
import enum
import inspect
import os
import warnings

import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks

import zerotron
import zerotron.comm
from zerotron.comm import api as compat_comm

# --- deepspeed.comm through zerotron.comm ---------------------------------------------------------


def test_zerotron_comm_has_deepspeeds_names_and_its_own():
    assert zerotron.comm.init_distributed is compat_comm.init_distributed
    assert zerotron.comm.init_distributed.__module__ == "zerotron.comm.groups"
    assert zerotron.comm.all_reduce is compat_comm.all_reduce and zerotron.comm.get_rank is compat_comm.get_rank
    assert zerotron.comm.ReduceOp is dist.ReduceOp
    assert (
        zerotron.comm.Comm.__module__ == "zerotron.comm.core"
        and zerotron.comm.shutdown.__module__ == "zerotron.comm.groups"
    )
    for name in compat_comm.__all__:
        assert getattr(zerotron.comm, name) is getattr(compat_comm, name), name
    for missing in ("no_such_function", "_require", "logger", "enum"):
        with pytest.raises(AttributeError, match=missing):
            getattr(zerotron.comm, missing)
    assert not hasattr(zerotron.comm, "__wrapped__")


def test_init_distributed_accepts_every_deepspeed_keyword():
    ds_keywords = [
        "dist_backend",
        "auto_mpi_discovery",
        "distributed_port",
        "verbose",
        "timeout",
        "init_method",
        "dist_init_required",
        "config",
        "rank",
        "world_size",
    ]
    inspect.signature(zerotron.comm.init_distributed).bind(**{k: None for k in ds_keywords})


def test_new_group_takes_zerotrons_group_timeout(monkeypatch):
    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "new_group", lambda ranks, **kwargs: calls.append((ranks, kwargs)) or "group")
    assert zerotron.comm.new_group([0, 1]) == "group"
    assert zerotron.comm.new_group([1], timeout=datetime.timedelta(seconds=5), backend="gloo") == "group"
    assert calls == [
        ([0, 1], {"timeout": zerotron.comm.group_timeout()}),
        ([1], {"timeout": datetime.timedelta(seconds=5), "backend": "gloo"}),
    ]


def test_rank_queries_before_any_process_group_name_the_fix():
    # a fresh interpreter: this test process may already hold a process group from another test
    import subprocess
    import sys

    code = (
        "import zerotron.comm as c\n"
        "try:\n    c.get_rank()\nexcept RuntimeError as e:\n    print('init_distributed' in str(e))\n"
        "print(c.is_initialized() is False and c.is_available())\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True"]


class DeepSpeedReduceOp(enum.Enum):  # DeepSpeed's own enum, as deepspeed.comm.ReduceOp is there
    SUM = 0
    MAX = 3


def _collectives():
    import zerotron as deepspeed
    import zerotron.comm as ds_dist

    comm = deepspeed.comm
    rank, world = comm.get_rank(), comm.get_world_size()
    out = {"rank": rank, "world": world, "local_rank": comm.get_local_rank(), "initialized": comm.is_initialized()}
    t = torch.tensor([rank + 1.0])
    ds_dist.all_reduce(t, prof=True, log_name="grads", debug="caller")
    out["all_reduce"] = t.item()
    t = torch.tensor([rank + 1.0])
    comm.all_reduce(t, op=comm.ReduceOp.MAX)
    out["all_reduce_max"] = t.item()
    t = torch.tensor([rank + 1.0])
    comm.all_reduce(t, op=DeepSpeedReduceOp.MAX)
    out["all_reduce_ds_enum"] = t.item()
    t = torch.tensor([rank + 1.0])
    comm.all_reduce(t, async_op=True).wait()
    out["all_reduce_async"] = t.item()
    a, b = torch.full((2,), rank + 1.0), torch.full((3,), 10.0 * (rank + 1))
    comm.all_reduce_coalesced([a, b])
    out["coalesced"] = (a.tolist(), b.tolist())
    a = torch.full((2, 2), rank + 1.0)
    comm.all_reduce_coalesced([a], async_op=True).wait()
    out["coalesced_async"] = a.tolist()
    out["inference_all_reduce"] = comm.inference_all_reduce(torch.tensor([rank + 2.0])).item()
    t = torch.tensor([10.0 * (rank + 1)])
    comm.broadcast(t, src=1)
    out["broadcast"] = t.item()
    objects = [{"from": rank}]
    comm.broadcast_object_list(objects, src=1)
    out["broadcast_object_list"] = objects
    parts = [torch.zeros(2) for _ in range(world)]
    comm.all_gather(parts, torch.full((2,), float(rank)))
    out["all_gather"] = [p.tolist() for p in parts]
    gathered = [None] * world
    comm.all_gather_object(gathered, {"rank": rank})
    out["all_gather_object"] = gathered
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        flat = torch.zeros(4)
        comm.all_gather_into_tensor(flat, torch.full((2,), rank + 1.0))
        flat2 = torch.zeros(4)
        comm.allgather_fn(flat2, torch.full((2,), rank + 5.0), async_op=True).wait()
        shard = torch.zeros(2)
        comm.reduce_scatter_tensor(shard, torch.arange(4.0) + rank)
        shard2 = torch.zeros(2)
        comm.reduce_scatter_fn(shard2, torch.arange(4.0) * (rank + 1))
        comm.all_reduce_coalesced([torch.ones(1)])
    out["warnings"] = [str(w.message) for w in caught]
    out["all_gather_into_tensor"], out["allgather_fn"] = flat.tolist(), flat2.tolist()
    out["reduce_scatter_tensor"], out["reduce_scatter_fn"] = shard.tolist(), shard2.tolist()
    shard3 = torch.zeros(2)
    comm.reduce_scatter(shard3, [torch.full((2,), rank + 1.0), torch.full((2,), 10.0 * (rank + 1))])
    out["reduce_scatter"] = shard3.tolist()
    t = torch.tensor([rank + 1.0])
    comm.reduce(t, dst=0)
    out["reduce_on_0"] = t.item() if rank == 0 else None
    received = torch.zeros(2)
    comm.all_to_all_single(received, torch.tensor([10.0 * rank, 10.0 * rank + 1]))
    out["all_to_all_single"] = received.tolist()
    ins, outs = [torch.tensor([100.0 * rank + d]) for d in range(world)], [torch.zeros(1) for _ in range(world)]
    comm.all_to_all(outs, ins)
    out["all_to_all"] = [o.item() for o in outs]
    targets = [torch.zeros(1) for _ in range(world)] if rank == 0 else None
    comm.gather(torch.tensor([rank + 7.0]), gather_list=targets, dst=0)
    out["gather"] = [g.item() for g in targets] if rank == 0 else None
    got = torch.zeros(1)
    comm.scatter(got, scatter_list=[torch.tensor([3.0]), torch.tensor([4.0])] if rank == 0 else None, src=0)
    out["scatter"] = got.item()
    comm.barrier()
    comm.monitored_barrier(timeout=datetime.timedelta(seconds=20))
    out["has"] = (
        comm.has_all_gather_into_tensor(),
        comm.has_reduce_scatter_tensor(),
        comm.has_all_reduce_coalesced(),
        comm.has_coalescing_manager(),
    )
    comm.configure(enabled=False, prof_all=True, prof_ops=["all_reduce"], verbose=False, debug=False)
    out["log_summary"] = comm.log_summary(return_dict=True)
    # dist is initialized by the harness: DeepSpeed's keywords are accepted and it stays as it is
    comm.init_distributed(
        dist_backend="gloo",
        auto_mpi_discovery=False,
        distributed_port=29500,
        verbose=False,
        timeout=datetime.timedelta(minutes=30),
        init_method=None,
        dist_init_required=None,
        config=None,
        rank=-1,
        world_size=-1,
    )
    out["after_init_distributed"] = (comm.get_world_size(), dist.get_backend())
    return out


def test_collectives_give_deepspeeds_values_on_two_ranks():
    r0, r1 = run_ranks(_collectives, 2)
    assert [(r["rank"], r["world"], r["local_rank"], r["initialized"]) for r in (r0, r1)] == [
        (0, 2, 0, True),
        (1, 2, 1, True),
    ]
    for r in (r0, r1):
        assert (r["all_reduce"], r["all_reduce_max"], r["all_reduce_ds_enum"], r["all_reduce_async"]) == (3, 2, 2, 3)
        assert r["coalesced"] == ([3.0, 3.0], [30.0, 30.0, 30.0]) and r["coalesced_async"] == [[3.0, 3.0]] * 2
        assert r["inference_all_reduce"] == 5.0
        assert r["broadcast"] == 20.0 and r["broadcast_object_list"] == [{"from": 1}]
        assert r["all_gather"] == [[0.0, 0.0], [1.0, 1.0]]
        assert r["all_gather_object"] == [{"rank": 0}, {"rank": 1}]
        assert r["all_gather_into_tensor"] == [1.0, 1.0, 2.0, 2.0] and r["allgather_fn"] == [5.0, 5.0, 6.0, 6.0]
        assert r["warnings"] == []  # torch 2.13's deprecated names are not called
        assert r["has"] == (True, True, True, True)
        assert r["log_summary"]["summary"] == {} and r["log_summary"]["metadata"]["world_size"] == 2
        assert r["after_init_distributed"] == (2, "gloo")
    # sum of [0,1,2,3] and [1,2,3,4] is [1,3,5,7]; sum of [0,1,2,3] and [0,2,4,6] is [0,3,6,9]
    assert (r0["reduce_scatter_tensor"], r1["reduce_scatter_tensor"]) == ([1.0, 3.0], [5.0, 7.0])
    assert (r0["reduce_scatter_fn"], r1["reduce_scatter_fn"]) == ([0.0, 3.0], [6.0, 9.0])
    assert (r0["reduce_scatter"], r1["reduce_scatter"]) == ([3.0, 3.0], [30.0, 30.0])
    assert r0["reduce_on_0"] == 3.0
    assert (r0["all_to_all_single"], r1["all_to_all_single"]) == ([0.0, 10.0], [1.0, 11.0])
    assert (r0["all_to_all"], r1["all_to_all"]) == ([0.0, 100.0], [1.0, 101.0])
    assert r0["gather"] == [7.0, 8.0] and (r0["scatter"], r1["scatter"]) == (3.0, 4.0)


def _point_to_point_and_groups():
    import zerotron as deepspeed

    comm = deepspeed.comm
    rank = comm.get_rank()
    out = {}
    buf = torch.zeros(3)
    if rank == 0:
        comm.send(torch.tensor([1.0, 2.0, 3.0]), dst=1)
        comm.irecv(buf, src=1).wait()
    else:
        comm.recv(buf, src=0)
        comm.isend(buf * 10, dst=0).wait()
    out["p2p"] = buf.tolist()
    group = comm.new_group([0, 1])
    t = torch.tensor([rank + 1.0])
    comm.all_reduce(t, group=group)
    out["group_all_reduce"] = t.item()
    out["group_ranks"] = comm.get_all_ranks_from_group(group)
    out["group_global_rank"] = comm.get_global_rank(group, 1)
    out["world_ranks"] = comm.get_all_ranks_from_group()
    out["world_group"] = comm.get_world_group() is dist.group.WORLD
    out["group_timeout_s"] = zerotron.comm.group_timeout().total_seconds()
    singles = [comm.new_group([0]), comm.new_group([1])]  # new_group is collective: every rank creates each
    mine = singles[rank]
    t = torch.tensor([rank + 5.0])
    comm.all_reduce(t, group=mine)
    out["single_group"] = (t.item(), comm.get_world_size(mine), comm.get_rank(mine))
    comm.barrier(group=group)
    return out


def test_point_to_point_and_new_groups_on_two_ranks():
    r0, r1 = run_ranks(_point_to_point_and_groups, 2)
    assert r1["p2p"] == [1.0, 2.0, 3.0] and r0["p2p"] == [10.0, 20.0, 30.0]
    for r in (r0, r1):
        assert r["group_all_reduce"] == 3.0 and r["group_ranks"] == [0, 1] and r["group_global_rank"] == 1
        assert r["world_ranks"] == [0, 1] and r["world_group"] and r["group_timeout_s"] > 0
    assert r0["single_group"] == (5.0, 1, 0) and r1["single_group"] == (6.0, 1, 0)


def _destroy_process_group():
    import zerotron as deepspeed

    deepspeed.comm.barrier()
    deepspeed.comm.destroy_process_group()
    return deepspeed.comm.is_initialized()


def test_destroy_process_group_tears_down():
    assert run_ranks(_destroy_process_group, 2) == [False, False]
