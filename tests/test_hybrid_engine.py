"""DeepSpeed's hybrid engine section, driven the way DeepSpeed-Chat's step 3 (PPO) drives its actor:
initialize with `hybrid_engine` enabled (and the keys the script sets), eval(), the model's own
generate() with synced_gpus under ZeRO-3, train(), then a training step. DeepSpeed's hybrid engine
gives every rank rank 0's random state when built, so sampled rollouts of the same prompt agree
across ranks; without the section each rank keeps its own."""

from __future__ import annotations

import warnings

import torch
from distributed import run_ranks
from test_zero3_hf import _tiny_llama

import zerotron


def _rollout(hybrid: bool):
    import torch.distributed as dist

    model = _tiny_llama(seed=3)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "hybrid_engine": {  # what DeepSpeed-Chat's get_train_ds_config writes for the actor
            "enabled": hybrid,
            "max_out_tokens": 32,
            "inference_tp_size": 1,
            "release_inference_cache": False,
            "pin_parameters": True,
            "tp_gather_partition_size": 8,
        },
    }
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.manual_seed(100 + dist.get_rank())  # the ranks' random states differ before initialize
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        engine, *_ = zerotron.initialize(model=model, optimizer=optimizer, config=config)
    named = [str(w.message) for w in record if "hybrid_engine" in str(w.message)]
    engine.eval()
    modes = [engine.module.training]
    prompt = torch.tensor([[5, 6, 7, 8]])  # the same prompt on every rank
    with torch.no_grad():
        seq = engine.module.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_length=12, pad_token_id=0, synced_gpus=True,
            do_sample=True,
        )  # fmt: skip
    engine.train()
    modes.append(engine.module.training)
    logits = engine(seq, attention_mask=torch.ones_like(seq), use_cache=False).logits
    loss = torch.nn.functional.cross_entropy(logits[0, :-1].float(), seq[0, 1:])
    engine.backward(loss)
    engine.step()
    return seq[0].tolist(), modes, named, torch.isfinite(loss).item()


def _both():
    return _rollout(True), _rollout(False)


def test_hybrid_engine_syncs_rollout_randomness_and_trains_under_zero3():
    (hybrid0, plain0), (hybrid1, plain1) = run_ranks(_both, 2, timeout=120)
    for got in (hybrid0, hybrid1, plain0, plain1):
        seq, modes, _, finite = got
        assert len(seq) == 12 and modes == [False, True] and finite
    assert hybrid0[0] == hybrid1[0]  # rank 0's random state: the same sampled tokens
    assert plain0[0] != plain1[0]  # negative control: each rank samples from its own state
    (named,) = hybrid0[2]
    assert "module.generate() runs the training model itself" in named and "max_out_tokens" in named
    assert plain0[2] == []  # a disabled section asks for nothing
