"""Checkpoints: exact resume, any topology to any other, atomic saves, clear errors, export."""

import json
import os

import pytest
import torch
import torch.distributed as dist
from distributed import RankError, run_ranks
from parity import assert_losses_close, ds_config, global_batches, make_model, micro_batches
from safetensors.torch import load_file

import zerotron
from zerotron.parallelize import to_pipeline

STEPS = 6
GLOBAL_BATCH = 4


def _engine(stage=1, tp=1, pp=1, pipe_form=False, layers=4, **extra):
    world = dist.get_world_size()
    dp = world // (tp * pp)
    gas = 2 if pp > 1 else 1
    config = ds_config(
        GLOBAL_BATCH // (dp * gas),
        gas,
        tensor_parallel={"autotp_size": tp},
        zero_optimization={"stage": stage, "stage3_param_persistence_threshold": 0},
        scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 4, "warmup_max_lr": 1e-3}},
        **extra,
    )
    model = make_model(n_layer=layers, n_kv_head=4)
    module = to_pipeline(model, pp, partition_method="type:_PipeBlock") if pp > 1 or pipe_form else model
    engine, *_ = zerotron.initialize(model=module, config=config)
    return engine, dp, gas


def _train(directory, steps, load=False, save=False, stage=1, tp=1, pp=1, pipe_form=False):
    engine, dp, gas = _engine(stage, tp, pp, pipe_form)
    client = None
    if load:
        _, client = engine.load_checkpoint(directory)
    batches = global_batches(STEPS, GLOBAL_BATCH)
    losses = []
    for b in batches[engine.global_steps : engine.global_steps + steps]:
        losses.append(engine.train_batch(iter(micro_batches(b, engine.coords.dp, dp, gas))).item())
    if save:
        engine.save_checkpoint(directory, client_state={"step": engine.global_steps})
    return losses, client


def test_exact_resume_is_bit_for_bit(tmp_path):
    d = str(tmp_path / "ck")
    straight = run_ranks(_train, 2, d, STEPS)[0][0]
    first = run_ranks(_train, 2, d, 3, False, True)[0][0]
    second, client = run_ranks(_train, 2, d, 3, True)[0]
    assert first + second == straight  # model, masters, Adam, scheduler, counters: all restored exactly
    assert client == {"step": 3}
    assert (tmp_path / "ck" / "latest").read_text() == "global_step3"


def _save_where_each_rank_says(root):
    import warnings

    engine, dp, gas = _engine()
    b = global_batches(1, GLOBAL_BATCH)[0]
    engine.train_batch(iter(micro_batches(b, engine.coords.dp, dp, gas)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # HelloDeepSpeed names its run directory by each rank's clock: a second apart at times
        engine.save_checkpoint(os.path.join(root, f"run-{dist.get_rank()}"))
    return [str(w.message) for w in caught]


def test_ranks_naming_different_save_dirs_write_one_checkpoint_under_rank_0s(tmp_path):
    warned = run_ranks(_save_where_each_rank_says, 2, str(tmp_path))
    assert all("save_dir differs across ranks" in " ".join(w) for w in warned)
    assert sorted(os.listdir(tmp_path)) == ["run-0"]  # (DeepSpeed: rank 1's files in run-1, no whole checkpoint)
    assert run_ranks(_train, 2, str(tmp_path / "run-0"), 1, True)[0][1] == {}  # it loads


# (world, stage, tp, pp, pipeline form) saving -> the same loading
@pytest.mark.parametrize(
    "save,load",
    [
        ((8, 1, 2, 2, True), (1, 0, 1, 1, True)),  # 3D with ZeRO-1 -> one process
        ((4, 3, 1, 1, False), (2, 1, 1, 1, False)),  # ZeRO-3 on 4 ranks -> ZeRO-1 on 2
        ((2, 0, 2, 1, False), (4, 2, 4, 1, False)),  # TP 2 -> TP 4 (with ZeRO-2)
        ((4, 1, 1, 2, True), (2, 2, 1, 1, False)),  # a pipeline of the GPT -> the plain GPT (same names)
    ],
)
def test_any_topology_loads_any_other(tmp_path, save, load):
    d = str(tmp_path / "ck")
    straight = run_ranks(_train, 1, d + "_ref", STEPS, False, False, 0, 1, 1, save[4])[0][0]
    first = run_ranks(_train, save[0], d, 3, False, True, *save[1:], timeout=180)[0][0]
    second = run_ranks(_train, load[0], d, 3, True, False, *load[1:], timeout=180)[0][0]
    assert_losses_close(first + second, straight, rtol=1e-5)


# ---- the engine's own dataloader across data-parallel sizes ------------------------------------------------
SAMPLES, EPOCH_STEPS = 40, 10  # one epoch is 10 steps of GLOBAL_BATCH samples


class _Recorded(torch.utils.data.Dataset):
    """Token sequences that note which of them the process reads."""

    def __init__(self):
        g = torch.Generator().manual_seed(5)
        self.tokens = torch.randint(0, 256, (SAMPLES, 17), generator=g)
        self.read = []

    def __len__(self):
        return SAMPLES

    def __getitem__(self, i):
        self.read.append(i)
        return self.tokens[i, :-1], self.tokens[i, 1:]


def _train_own_data(directory, steps, tp, gas, load):
    """Train on zerotron.initialize(training_data=...)'s dataloader; (losses, indices this data-parallel
    rank read, or None on the other tensor-parallel ranks)."""
    dp = dist.get_world_size() // tp
    data = _Recorded()
    config = ds_config(GLOBAL_BATCH // (dp * gas), gas, tensor_parallel={"autotp_size": tp})
    engine, _, loader, _ = zerotron.initialize(
        model=make_model(n_layer=2, n_kv_head=4), config=config, training_data=data
    )
    if load:
        engine.load_checkpoint(directory)
    losses = [engine.train_batch().item() for _ in range(steps)]
    if not load:
        engine.save_checkpoint(directory)
    return losses, data.read if engine.coords.tp == 0 else None


# (world, tensor-parallel size, accumulation) saving -> loading: the data-parallel size changes
@pytest.mark.parametrize(
    "save,load",
    [
        ((2, 1, 1), (1, 1, 2)),  # dp 2 -> 1
        ((1, 1, 1), (2, 1, 2)),  # dp 1 -> 2
        ((2, 1, 1), (4, 1, 1)),  # dp 2 -> 4
        ((2, 1, 2), (2, 2, 1)),  # dp 2 -> tp 2 (the same world)
        ((2, 2, 1), (4, 2, 2)),  # tp 2: dp 1 -> 2
        ((4, 2, 1), (2, 2, 2)),  # tp 2: dp 2 -> 1
    ],
)
def test_the_engines_dataloader_resumes_on_another_data_parallel_size(tmp_path, save, load):
    """Every sample of the epoch read exactly once across the restart, whatever the new data-parallel
    size and accumulation, and the same global batches (so the same losses) as one process straight."""
    d = str(tmp_path / "ck")
    straight = run_ranks(_train_own_data, 1, d + "_ref", EPOCH_STEPS + 2, 1, 1, True)[0][0]
    first = run_ranks(_train_own_data, save[0], d, 3, *save[1:], False, timeout=120)
    second = run_ranks(_train_own_data, load[0], d, EPOCH_STEPS - 3 + 2, *load[1:], True, timeout=120)
    assert_losses_close(first[0][0] + second[0][0], straight, rtol=1e-5)
    next_epoch = 2 * GLOBAL_BATCH * load[1] // load[0]  # what each data-parallel rank read of the next epoch
    epoch = [i for _, indices in first if indices is not None for i in indices] + [
        i for _, indices in second if indices is not None for i in indices[:-next_epoch]
    ]
    assert sorted(epoch) == list(range(SAMPLES))


# ---- safety ---------------------------------------------------------------------------------------------
def _save_then_crash(directory):
    engine, dp, _ = _engine()
    engine.train_batch(iter(micro_batches(global_batches(1, GLOBAL_BATCH)[0], 0, 1, 1)))
    engine.save_checkpoint(directory, tag="good")
    import zerotron.checkpoint.save as save_module

    real = save_module.save_file

    def dies_midway(tensors, path, metadata=None):
        with open(path, "wb") as f:
            f.write(b"\0" * 1000)  # half a file, then the process "dies"
        raise SystemExit("killed")

    save_module.save_file = dies_midway
    try:
        engine.save_checkpoint(directory, tag="doomed")
    except SystemExit:
        pass
    finally:
        save_module.save_file = real
    return engine.global_steps


def _rank_exits_while_saving(directory):
    engine, dp, _ = _engine()
    engine.train_batch(iter(micro_batches(global_batches(1, GLOBAL_BATCH)[0], engine.coords.dp, dp, 1)))
    engine.save_checkpoint(directory, tag="good")
    if dist.get_rank() == 1:
        import zerotron.checkpoint.save as save_module

        def exits_midway(tensors, path, metadata=None):
            with open(path, "wb") as f:
                f.write(b"\0" * 1000)
            os._exit(1)  # the process dies half-way through its file

        save_module.save_file = exits_midway
    engine.save_checkpoint(directory, tag="doomed")


def _load(directory, tag=None):
    engine, _, _ = _engine()
    path, client = engine.load_checkpoint(directory, tag=tag)
    return path, engine.global_steps


def test_a_save_killed_midway_leaves_the_previous_checkpoint(tmp_path):
    d = tmp_path / "ck"
    run_ranks(_save_then_crash, 1, str(d))
    assert (d / "latest").read_text() == "good"
    assert not (d / "doomed").exists()  # only the .partial directory, never a half checkpoint
    path, steps = run_ranks(_load, 1, str(d))[0]
    assert path.endswith("good") and steps == 1


def test_a_rank_exiting_during_the_write_leaves_the_previous_checkpoint_loadable(tmp_path):
    d = tmp_path / "ck"
    with pytest.raises(RankError):  # rank 1 died; rank 0 fails in the next collective instead of hanging
        run_ranks(_rank_exits_while_saving, 2, str(d), timeout=60)
    assert (d / "latest").read_text() == "good"
    assert not (d / "doomed").exists()
    for path, steps in run_ranks(_load, 2, str(d)):
        assert path.endswith("good") and steps == 1


def _saved(tmp_path, world=2):
    d = tmp_path / "ck"
    run_ranks(_train, world, str(d), 1, False, True)
    return d, d / "global_step1"


def test_corrupted_truncated_or_missing_files_are_named(tmp_path):
    d, ck = _saved(tmp_path)
    shard = ck / "rank00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-10] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(RankError, match="rank00001.safetensors is corrupted or truncated"):
        run_ranks(_load, 2, str(d))
    shard.write_bytes(bytes(data[: len(data) // 2]))
    with pytest.raises(RankError, match="rank00001.safetensors is corrupted or truncated"):
        run_ranks(_load, 2, str(d))
    shard.unlink()
    with pytest.raises(RankError, match="rank00001.safetensors is missing"):
        run_ranks(_load, 2, str(d))
    (ck / "meta.json").unlink()
    with pytest.raises(RankError, match="meta.json is missing"):
        run_ranks(_load, 2, str(d))


def _load_other_model(directory):
    config = ds_config(2, 1, zero_optimization={"stage": 1})
    engine, *_ = zerotron.initialize(model=make_model(n_layer=4, n_kv_head=4, d_model=128), config=config)
    engine.load_checkpoint(directory)


def test_a_checkpoint_of_another_model_is_refused(tmp_path):
    d, _ = _saved(tmp_path)
    with pytest.raises(RankError, match="has shape .* the checkpoint is from a different model"):
        run_ranks(_load_other_model, 2, str(d))


def _load_and_log(directory):
    import logging

    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("zerotron").addHandler(handler)
    return _load(directory), records


def test_no_latest_means_nothing_to_load(tmp_path):
    ((result, log),) = run_ranks(_load_and_log, 1, str(tmp_path))
    assert result == (None, 0) and f"{tmp_path} has no 'latest' file" in log[-1]
    ((result, log),) = run_ranks(_load_and_log, 1, str(tmp_path / "missing"))
    assert result == (None, 0) and f"{tmp_path / 'missing'} does not exist: nothing to load" in log[-1]


# ---- export ----------------------------------------------------------------------------------------------
def _trained_state(directory, stage, tp):
    engine, dp, _ = _engine(stage, tp)
    engine.train_batch(iter(micro_batches(global_batches(1, GLOBAL_BATCH)[0], engine.coords.dp, dp, 1)))
    engine.save_checkpoint(directory)
    engine.save_16bit_model(directory + "_16", "weights.safetensors")
    return zerotron.zero.consolidated_state_dict(engine.module)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_convert_writes_consolidated_weights(tmp_path, dtype):
    from zerotron.checkpoint.export import convert

    d = str(tmp_path / "ck")
    state = run_ranks(_trained_state, 4, d, 2, 2)[0]
    path = convert(d, tmp_path / "out", dtype)
    weights = load_file(str(path))
    want = {k: v for k, v in state.items() if k != "lm_head.weight" or "lm_head.weight" in weights}
    assert set(weights) == set(want)
    for k, v in want.items():
        assert weights[k].dtype == (torch.float32 if dtype == "fp32" else torch.bfloat16)
        assert torch.equal(weights[k], v.to(weights[k].dtype)), k
    model = make_model(n_layer=4, n_kv_head=4)
    model.load_state_dict({k: v.float() for k, v in weights.items()})  # a plain model loads it
    sixteen = load_file(str(tmp_path / "ck_16" / "weights.safetensors"))
    assert all(torch.equal(sixteen[k], state[k]) for k in sixteen)


def test_convert_command_line(tmp_path):
    import subprocess
    import sys

    d = str(tmp_path / "ck")
    run_ranks(_trained_state, 2, d, 1, 1)
    out = subprocess.run(
        [sys.executable, "-m", "zerotron.cli", "convert", d, str(tmp_path / "out"), "--dtype", "bf16"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert json.loads((tmp_path / "out" / "zerotron_source.json").read_text())["dtype"] == "bf16"
    missing = subprocess.run(
        [sys.executable, "-m", "zerotron.cli", "convert", str(tmp_path / "nothing"), str(tmp_path / "o2")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert missing.returncode == 1 and "nothing does not exist" in missing.stderr
    (tmp_path / "empty").mkdir()
    bad = subprocess.run(
        [sys.executable, "-m", "zerotron.cli", "convert", str(tmp_path / "empty"), str(tmp_path / "o2")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 1 and "neither a checkpoint" in bad.stderr


def _frozen_embedding(directory, stage, load):
    model = make_model(n_kv_head=4)
    model.tok_emb.weight.requires_grad_(False)  # frozen: under ZeRO-3 it still lives in a partitioned unit
    config = ds_config(2, 1, zero_optimization={"stage": stage, "stage3_param_persistence_threshold": 0})
    engine, *_ = zerotron.initialize(model=model, config=config)
    if load:
        engine.load_checkpoint(directory)
    else:
        for b in global_batches(2, 4):
            engine.train_batch(iter(micro_batches(b, engine.coords.dp, 2, 1)))
        engine.save_checkpoint(directory)
    return zerotron.zero.consolidated_state_dict(engine.module)


@pytest.mark.parametrize("stage", [1, 3])
def test_frozen_parameters_are_saved_and_restored(tmp_path, stage):
    saved = run_ranks(_frozen_embedding, 2, str(tmp_path), stage, False)[0]
    loaded = run_ranks(_frozen_embedding, 2, str(tmp_path), stage, True)[0]
    assert all(torch.equal(saved[k], loaded[k]) for k in saved)
