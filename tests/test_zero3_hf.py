"""ZeRO-3 as the Hugging Face stack uses it: models partitioned as they are built (zero.Init),
weights written through GatheredParameters(modifier_rank=0) before zerotron.initialize,
from_pretrained under ZeRO-3, and generation of different lengths per rank inside
GatheredParameters. Tiny models from configs, generated tokens, no downloads."""

from pathlib import Path

import torch
from distributed import run_ranks
from parity import (
    assert_losses_close,
    ds_config,
    global_batches,
    hf_loss,
    make_model,
    max_weight_diff,
    micro_batches,
    reference_training,
)

import zerotron

STEPS = 3


def _whole_bytes(params) -> int:
    """Bytes of whole parameter values among `params` (each storage counted once): placeholders
    hold none, and zero.Init's pieces (ds_tensor) are not parameters."""
    storages = {}
    for p in params:
        if not p.is_meta and p.numel() > 0:
            st = p.untyped_storage()
            storages[st.data_ptr()] = st.nbytes()
    return sum(storages.values())


def _weights(seed):
    """Target weights for the GatheredParameters writes (different from the model's own init)."""
    torch.manual_seed(seed)
    model = make_model()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    return {k: v.clone() for k, v in model.state_dict().items()}


# ---- Init + GatheredParameters(modifier_rank=0) before initialize -------------------------------
def _init_write_train(target):
    import torch.distributed as dist

    from zerotron.zero import partitioned_init, units

    rank, dp = dist.get_rank(), dist.get_world_size()
    peaks = {"init": 0, "write": 0, "units": 0}

    built = []  # every module Init has partitioned so far, and the one it is about to partition

    def observe(what, module):
        built.append(module)
        params = [p for m in built for p in m.parameters(recurse=False)]
        peaks["init"] = max(peaks["init"], _whole_bytes(params))

    partitioned_init.observer = observe
    try:
        with zerotron.zero.Init():
            model = make_model(seed=rank)  # ranks seeded apart on purpose: Init takes rank 0's generator
    finally:
        partitioned_init.observer = None
    pieces = sum(p.ds_tensor.numel() * 4 for p in {id(p): p for p in model.parameters()}.values())
    statuses = {p.ds_status.name for p in model.parameters()}
    numels = {p.numel() for p in model.parameters()}
    # a loader as Transformers' zero3 path: one module at a time, rank 0 reads the file
    for name, m in model.named_modules():
        own = dict(m.named_parameters(prefix=name, recurse=False))
        if not own:
            continue
        with zerotron.zero.GatheredParameters(list(own.values()), modifier_rank=0):
            peaks["write"] = max(peaks["write"], _whole_bytes(model.parameters()))
            if rank == 0:
                with torch.no_grad():
                    for k, p in own.items():
                        p.copy_(target[k])
    original_release = units.Unit.release

    def release(unit):
        peaks["units"] = max(peaks["units"], _whole_bytes(model.parameters()))
        original_release(unit)

    units.Unit.release = release
    try:
        engine, *_ = zerotron.initialize(
            model=model, config=ds_config(2, 1, zero_optimization={"stage": 3, "stage3_param_persistence_threshold": 0})
        )
    finally:
        units.Unit.release = original_release
    initial = zerotron.zero.consolidated_state_dict(engine.module)
    losses = [engine.train_batch(iter(micro_batches(b, rank, dp, 1))).item() for b in global_batches(STEPS, 2 * dp)]
    final = zerotron.zero.consolidated_state_dict(engine.module)
    return dict(
        peaks=peaks,
        pieces=pieces,
        statuses=statuses,
        numels=numels,
        initial=initial,
        losses=losses,
        final=final,
        held=engine.memory_report()["params"],
    )


def test_init_then_gathered_writes_then_training_matches_one_process():
    target = _weights(7)
    results = run_ranks(_init_write_train, 2, target, timeout=120)
    model = make_model()
    full = sum(p.numel() * 4 for p in model.parameters())
    largest_module = max(sum(p.numel() * 4 for p in m.parameters(recurse=False)) for m in model.modules())
    largest_unit = max(sum(p.numel() * 4 for p in layer.parameters()) for layer in model.layers)
    root_unit = full - sum(p.numel() * 4 for p in model.layers.parameters())
    model.load_state_dict(target)
    ref_losses, ref_state = reference_training(global_batches(STEPS, 4), model=model)
    for r in results:
        assert r["statuses"] == {"NOT_AVAILABLE"} and r["numels"] == {0}
        assert r["pieces"] <= full / 2 + 64 * 4  # this rank's half, plus per-parameter padding
        # never the whole model: one module while building, one module's parameters while writing,
        # one unit while zerotron.initialize builds its buckets
        assert r["peaks"]["init"] <= largest_module, (r["peaks"], largest_module, full)
        assert r["peaks"]["write"] <= largest_module
        assert r["peaks"]["units"] <= max(largest_unit, root_unit) < full / 2
        assert r["held"] <= full / 2 * 1.01
        assert max_weight_diff(r["initial"], target) == 0.0  # rank 0's writes reached every shard
        assert_losses_close(r["losses"], ref_losses, rtol=1e-5)
        assert max_weight_diff(r["final"], ref_state) < 1e-5


def _init_default_values():
    import torch.distributed as dist

    with zerotron.zero.Init():
        model = make_model(seed=dist.get_rank())  # rank 0's generator wins
    with zerotron.zero.GatheredParameters(list(model.parameters())):
        whole = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return whole, {p.numel() for p in model.parameters()}


def test_init_values_equal_the_unpartitioned_model_from_the_same_seed():
    ref = make_model(seed=0).state_dict()
    for whole, numels in run_ranks(_init_default_values, 2):
        assert max_weight_diff(whole, ref) == 0.0  # module init, then the model's _init_weights, in order
        assert numels == {0}  # released again after the block


# ---- from_pretrained under ZeRO-3 (HfDeepSpeedConfig) ------------------------------------------
def _tiny_llama(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg)


def _hf_zero3(ds):
    """What HfDeepSpeedConfig does when Transformers sees deepspeed: keep the config alive and
    register it (the forkserver imported Transformers before the alias existed)."""
    zerotron.as_deepspeed()
    from accelerate.utils.deepspeed import HfDeepSpeedConfig
    from transformers.integrations import deepspeed as hf_ds

    keep = HfDeepSpeedConfig(ds)
    hf_ds.set_hf_deepspeed_config(keep)
    return keep


def _from_pretrained(path, train):
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM
    from transformers.integrations import is_deepspeed_zero3_enabled

    ds = ds_config(2, 1, zero_optimization={"stage": 3, "stage3_param_persistence_threshold": 0})
    keep = _hf_zero3(ds)
    assert is_deepspeed_zero3_enabled()
    model = AutoModelForCausalLM.from_pretrained(path)
    statuses = {p.ds_status.name for p in model.parameters()}
    numels = {p.numel() for p in model.parameters()}
    with zerotron.zero.GatheredParameters(list(model.parameters())):
        loaded = {k: v.detach().clone() for k, v in model.state_dict().items()}
    losses = []
    if train:
        engine, *_ = zerotron.initialize(model=model, config=ds)
        rank, dp = dist.get_rank(), dist.get_world_size()
        for x, _ in global_batches(STEPS, 2 * dp):
            mine = x.chunk(dp)[rank]
            losses.append(engine.train_batch(iter([{"input_ids": mine, "labels": mine}])).item())
    # from_config under ZeRO-3: Transformers' initialize_weights_zero3 writes through
    # GatheredParameters(modifier_rank=0) before initialize
    torch.manual_seed(11)
    fresh = AutoModelForCausalLM.from_config(model.config)
    fresh_numels = {p.numel() for p in fresh.parameters()}
    with zerotron.zero.GatheredParameters(list(fresh.parameters())):
        initialized = {k: v.detach().clone() for k, v in fresh.state_dict().items()}
    del keep
    return statuses, numels | fresh_numels, loaded, losses, initialized


def test_from_pretrained_under_zero3_gives_the_saved_weights(tmp_path):
    saved = _tiny_llama(seed=3)
    saved.save_pretrained(tmp_path)
    want = {k: v.clone() for k, v in saved.state_dict().items()}
    results = run_ranks(_from_pretrained, 2, str(tmp_path), True, timeout=120)
    ref_losses, _ = reference_training(global_batches(STEPS, 4), model=saved, forward=hf_loss)
    from transformers import AutoModelForCausalLM

    torch.manual_seed(11)
    fresh = AutoModelForCausalLM.from_config(saved.config).state_dict()
    for statuses, numels, loaded, losses, initialized in results:
        assert statuses == {"NOT_AVAILABLE"} and numels == {0}
        assert set(initialized) == set(fresh)
        # the same init scheme (Transformers' construction order differs under ZeRO-3, so the
        # random draws do too): norms at one, matrices at std initializer_range
        for k, v in fresh.items():
            got = initialized[k]
            if "norm" in k:
                assert torch.equal(got, v), k
            else:
                assert abs(got.std().item() - v.std().item()) < 0.1 * v.std().item(), (k, got.std(), v.std())
        assert set(loaded) == set(want)
        assert max_weight_diff(loaded, want) == 0.0
        assert_losses_close(losses, ref_losses, rtol=1e-5)


# ---- generation of different lengths inside GatheredParameters ---------------------------------
def _generate_gathered(path):
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    ds = ds_config(1, 1, zero_optimization={"stage": 3, "stage3_param_persistence_threshold": 0})
    keep = _hf_zero3(ds)
    model = AutoModelForCausalLM.from_pretrained(path)
    engine, *_ = zerotron.initialize(model=model, config=ds)
    engine.module.eval()
    prompt = torch.tensor([[5, 6, 7, 8]])
    new = 3 if dist.get_rank() == 0 else 9
    with zerotron.zero.GatheredParameters(engine.module.parameters()):  # as TRL's unwrap_model_for_generation
        with zerotron.zero.GatheredParameters(engine.module.parameters()):  # nested: still pinned
            pass
        # synced_gpus=False: no rank waits for the others (Transformers turns it on under ZeRO-3),
        # so only pinned units keep the ranks' collectives in step
        out = engine.module.generate(
            prompt, max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0, synced_gpus=False
        )[0].tolist()
    released = {p.numel() for p in engine.module.parameters()}
    # training still works after the block (units released and gathered in step again)
    x = global_batches(1, 2)[0][0].chunk(2)[dist.get_rank()]
    loss = engine.train_batch(iter([{"input_ids": x, "labels": x}])).item()
    del keep
    return out, released, loss


def test_generation_of_different_lengths_inside_gathered_parameters(tmp_path):
    saved = _tiny_llama(seed=4)
    saved.save_pretrained(tmp_path)
    short, long = run_ranks(_generate_gathered, 2, str(tmp_path), timeout=120)
    want = (
        saved.eval()
        .generate(torch.tensor([[5, 6, 7, 8]]), max_new_tokens=9, do_sample=False, eos_token_id=None, pad_token_id=0)[0]
        .tolist()
    )
    assert long[0] == want and short[0] == want[:7]
    assert short[1] == {0} and long[1] == {0}
    assert short[2] > 0 and long[2] > 0


# ---- TRL's SFTTrainer under ZeRO-3 against plain DDP -----------------------------------------------
SFT_SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "hf_trl_sft.py"


def _torchrun(script, *args, timeout=300, nproc=2):
    import os
    import subprocess
    import sys

    from distributed import free_port

    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_", "ZEROTRON_AS_DEEPSPEED"))
    }
    env.update(OMP_NUM_THREADS="1")  # the script turns the alias on itself (ds) or not at all (ddp)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--master_port",
        str(free_port()),
        str(script),
        *map(str, args),
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]


def test_trl_sft_trainer_under_zero3_matches_ddp(tmp_path):
    import json

    import pytest

    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    _tiny_llama(seed=5).save_pretrained(tmp_path / "model")
    for mode in ("ddp", "ds"):
        _torchrun(SFT_SCRIPT, mode, tmp_path / "model", tmp_path)
    ddp = json.loads((tmp_path / "ddp.json").read_text())
    ds = json.loads((tmp_path / "ds.json").read_text())
    assert ds["engine"].startswith("zerotron.engine") and not ddp["engine"].startswith("zerotron.")
    assert ds["partitioned"]  # from_pretrained ran inside zero.Init: pieces only
    assert len(ds["losses"]) == 3
    assert_losses_close(ds["losses"], ddp["losses"], rtol=1e-5)


def test_trl_sft_trainer_with_expert_parallelism_matches_ddp(tmp_path):
    """A Mixtral (4 experts, top-2) loaded by from_pretrained inside zero.Init, its experts split over
    the 2 ranks by the config's expert_parallel section under ZeRO-3: DDP's losses."""
    import json

    import pytest
    from transformers import MixtralConfig, MixtralForCausalLM

    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    torch.manual_seed(5)
    sizes = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    cfg = MixtralConfig(**sizes, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)
    MixtralForCausalLM(cfg).save_pretrained(tmp_path / "model")
    for mode in ("ddp", "ep"):
        _torchrun(SFT_SCRIPT, mode, tmp_path / "model", tmp_path)
    ddp, ep = (json.loads((tmp_path / f"{m}.json").read_text()) for m in ("ddp", "ep"))
    assert ep["engine"].startswith("zerotron.engine") and ep["partitioned"] and len(ep["losses"]) == 3
    assert_losses_close(ep["losses"], ddp["losses"], rtol=1e-5)


def test_trl_sft_trainer_with_ulysses_matches_one_process(tmp_path):
    """SFTConfig(parallelism_config=ParallelismConfig(sp_backend="deepspeed", sp_size=2)) at ZeRO-3:
    each sequence split over the 2 ranks, the ranks' batches in turn: one process's losses."""
    import json

    import pytest

    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    _tiny_llama(seed=5).save_pretrained(tmp_path / "model")
    _torchrun(SFT_SCRIPT, "ddp", tmp_path / "model", tmp_path, nproc=1)
    _torchrun(SFT_SCRIPT, "sp", tmp_path / "model", tmp_path)
    one = json.loads((tmp_path / "ddp.json").read_text())
    sp = json.loads((tmp_path / "sp.json").read_text())
    assert sp["engine"].startswith("zerotron.engine") and len(sp["losses"]) == 3
    assert_losses_close(sp["losses"], one["losses"], rtol=1e-5)
