"""initialize() as DeepSpeed scripts call it, the engine's accessors, and the topology."""

import argparse
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks
from parity import LR, ds_config, make_model

import zerotron
from zerotron.topology import Topology


def test_plain_process_without_launcher_is_world_size_one():
    code = (
        "import torch, zerotron\n"
        "from zerotron.models.gpt import GPT, config_for\n"
        "m = GPT(config_for('tiny', max_seq_len=8))\n"
        "e, o, d, s = zerotron.initialize(model=m, config={'train_batch_size': 2, "
        "'optimizer': {'type': 'SGD', 'params': {'lr': 0.1}}})\n"
        "x = torch.randint(0, 256, (2, 8))\n"
        "e.backward(e(x, x)); e.step()\n"
        "print(e.world_size, e.dp_world_size, e.global_steps, type(o).__name__, d, s)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "1", "1", "SGD", "None", "None"]


_TCP_INIT = """
import sys, torch, torch.distributed as dist, zerotron
rank, port = int(sys.argv[1]), sys.argv[2]
zerotron.init_distributed("gloo", False, 29500, False, init_method="tcp://127.0.0.1:" + port, rank=rank, world_size=2)
t = torch.tensor([rank + 1.0])
dist.all_reduce(t)
print(dist.get_rank(), dist.get_world_size(), t.item())
"""


def test_init_distributed_takes_deepspeeds_arguments_in_its_order():
    # positional (backend, auto_mpi_discovery, distributed_port, verbose) as DeepSpeed's, and an
    # explicit tcp:// rendezvous with rank and world_size, no launcher environment
    from distributed import free_port

    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _TCP_INIT, str(r), port],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    assert sorted(o[0].split()[0] for o in outs) == ["0", "1"]
    assert all(o[0].split()[1:] == ["2", "3.0"] for o in outs)


def _accessors():
    engine, optimizer, loader, scheduler = zerotron.initialize(
        model=make_model(),
        config=ds_config(
            2,
            3,
            scheduler={
                "type": "WarmupLR",
                "params": {
                    "warmup_min_lr": 0.0,
                    "warmup_max_lr": "auto",
                    "warmup_num_steps": 10,
                    "warmup_type": "linear",
                },
            },
        ),
        training_data=torch.utils.data.TensorDataset(torch.randint(0, 256, (40, 16)), torch.randint(0, 256, (40, 16))),
    )
    out = {
        "mbs": engine.train_micro_batch_size_per_gpu(),
        "gas": engine.gradient_accumulation_steps(),
        "tbs": engine.train_batch_size(),
        "stage": engine.zero_optimization_stage(),
        "print": (engine.steps_per_print(), engine.wall_clock_breakdown()),  # BingBertSquad copies them to its args
        "boundary": [],
        "lr": [],
        "rank": engine.global_rank,
        "local_rank": engine.local_rank,
        "loader_len": len(loader),
        "module_is_model": engine.module is not None,
    }
    for _ in range(2):
        loss = engine.train_batch()
        out["lr"].append(engine.get_lr()[0])
        out["loss_finite"] = bool(torch.isfinite(loss))
    for _ in range(3):
        out["boundary"].append(engine.is_gradient_accumulation_boundary())
        engine.step()  # counting micro-steps only (no backward needed for the boundary logic)
    out["steps"] = engine.global_steps
    out["sched_is_engine_sched"] = scheduler is engine.lr_scheduler and optimizer is engine.optimizer
    return out


def test_initialize_returns_deepspeeds_tuple_and_accessors():
    r0, r1 = run_ranks(_accessors, 2)
    assert (r0["mbs"], r0["gas"], r0["tbs"], r0["stage"]) == (2, 3, 12, 0)
    assert r0["print"] == (10**6, False)
    assert (r0["rank"], r1["rank"], r1["local_rank"]) == (0, 1, 1)
    assert r0["loader_len"] == 10  # 40 samples / 2 ranks / micro-batch 2
    # DeepSpeed's WarmupLR sets iteration 0's lr at construction, and its first step() is
    # iteration 0 again: the lr after two optimizer steps is 1/10 of the way up.
    assert r0["lr"] == pytest.approx([0.0, LR / 10])
    assert r0["boundary"] == [False, False, True] and r0["steps"] == 3
    assert r0["sched_is_engine_sched"] and r0["loss_finite"]


def _conflicting_optimizers():
    import warnings

    model = make_model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _, optimizer, *_ = zerotron.initialize(model=model, optimizer=sgd, config=ds_config(2, 1))
    return [str(w.message) for w in caught], optimizer.param_groups[0]["lr"], "momentum" in optimizer.param_groups[0]


def test_two_optimizers_train_with_the_clients_and_warn():
    """DeepSpeed trains with initialize(optimizer=...)'s and ignores the config's section (DeepSpeedExamples'
    GAN gives both): zerotron does the same and names the section it ignores."""
    (caught, lr, sgd), _ = run_ranks(_conflicting_optimizers, 2)
    assert lr == 0.1 and sgd  # the client's SGD, not the config's AdamW
    assert any("optimizer section (AdamW) is ignored" in m for m in caught), caught


def _client_optimizer_and_args(config_path):
    parser = zerotron.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", config_path])
    model = make_model()
    engine, optimizer, _, _ = zerotron.initialize(
        args=args, model=model, optimizer=lambda params: torch.optim.SGD(params, lr=0.5)
    )
    x = torch.randint(0, 256, (2, 16))
    before = model.lm_head.weight.detach().clone()
    engine.backward(engine(x, x))
    engine.step()
    grad_step = (before - model.lm_head.weight.detach()).abs().max().item()
    return type(optimizer).__name__, optimizer.param_groups[0]["lr"], grad_step > 0


def test_args_deepspeed_config_and_callable_optimizer(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{"train_micro_batch_size_per_gpu": 2}')
    name, lr, moved = run_ranks(_client_optimizer_and_args, 2, str(path))[0]
    assert (name, lr, moved) == ("SGD", 0.5, True)


def test_topology_places_tensor_parallel_ranks_innermost():
    topo = Topology(8, tp=2, pp=2)
    assert topo.shape == (2, 2, 1, 1, 2)  # pp, dp, cp, sp, tp
    assert [tuple(vars(topo.coords(r)).values()) for r in range(8)] == [  # pp, dp, sp, tp, cp
        (0, 0, 0, 0, 0),
        (0, 0, 0, 1, 0),
        (0, 1, 0, 0, 0),
        (0, 1, 0, 1, 0),
        (1, 0, 0, 0, 0),
        (1, 0, 0, 1, 0),
        (1, 1, 0, 0, 0),
        (1, 1, 0, 1, 0),
    ]
    assert topo.group_ranks("tp", 5) == [4, 5]
    assert topo.group_ranks("dp", 5) == [5, 7]
    assert topo.group_ranks("pp", 5) == [1, 5]
    with pytest.raises(zerotron.ConfigError, match="must divide the world size"):
        Topology(6, tp=4)


def test_sequence_ranks_sit_between_data_and_tensor_ranks_and_replicas_span_both():
    """DeepSpeed's sequence groups are consecutive ranks (tp 1); the ranks holding the same
    parameters (ZeRO's group) are every data and sequence rank of one (pp, tp) place."""
    topo = Topology(8, sp=2)
    assert (topo.dp, topo.sp, topo.replicas) == (4, 2, 8)
    assert topo.group_ranks("sp", 5) == [4, 5] and topo.group_ranks("dp", 5) == [1, 3, 5, 7]
    topo = Topology(8, tp=2, sp=2)
    assert topo.shape == (1, 2, 1, 2, 2) and vars(topo.coords(6)) == {"pp": 0, "dp": 1, "sp": 1, "tp": 0, "cp": 0}
    assert topo.group_ranks("sp", 6) == [4, 6] and topo.group_ranks("replicas", 6) == [0, 2, 4, 6]
    assert all(topo.rank_of(**vars(topo.coords(r))) == r for r in range(8))
    # ring ranks outside Ulysses' (which stay neighbours), the sequence group both
    topo = Topology(8, sp=2, cp=2)
    assert (topo.dp, topo.seq, topo.replicas) == (2, 4, 8)
    assert topo.group_ranks("sp", 5) == [4, 5] and topo.group_ranks("cp", 5) == [5, 7]
    assert topo.group_ranks("seq", 5) == [4, 5, 6, 7] and topo.group_ranks("dp", 5) == [1, 5]
    assert all(topo.rank_of(**vars(topo.coords(r))) == r for r in range(8))


def _groups():
    topo = Topology(4, tp=2).build_groups()
    return {dim: dist.get_process_group_ranks(topo.group(dim)) for dim in ("pp", "dp", "tp")}


def test_topology_builds_matching_process_groups():
    results = run_ranks(_groups, 4)
    topo = Topology(4, tp=2)
    for rank, groups in enumerate(results):
        for dim, ranks in groups.items():
            assert ranks == topo.group_ranks(dim, rank)


def _manual_boundary():
    engine, *_ = zerotron.initialize(model=make_model(), config=ds_config(2, 3))
    x = torch.randint(0, 256, (2, 16))
    engine.set_gradient_accumulation_boundary(False)
    returned = []
    for _ in range(2):
        loss = engine(x, x)
        returned.append((engine.backward(loss).item(), loss.item()))
    quiet = engine.comm_stats()["all_reduce"]
    engine.set_gradient_accumulation_boundary(True)
    engine.backward(engine(x, x))
    engine.step()
    return returned, quiet, engine.comm_stats()["all_reduce"] > 0, engine.global_steps


def test_manual_accumulation_boundary_and_backward_return():
    returned, quiet, reduced, steps = run_ranks(_manual_boundary, 2)[0]
    assert all(r == pytest.approx(loss / 3) for r, loss in returned)  # DeepSpeed returns loss / gas
    assert quiet == 0 and reduced and steps == 1
