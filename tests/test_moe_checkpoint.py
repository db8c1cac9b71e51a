"""Checkpoints of expert-parallel training (issue 31) are topology-free: experts are saved under their
global numbers, so a run saved at one expert-parallel size and ZeRO stage resumes at another and goes on
like one process holding every expert (AdamW: the moments must land on the right experts); the whole
model (save_16bit_model, `zerotron convert`) holds every expert of every rank under the names one
process would give them, and loads into that one-process model."""

import pytest
from distributed import run_ranks
from moe_model import TinyMoE, batches, reference
from safetensors.torch import load_file

STEPS = 4  # saved after 2, resumed for 2; DeepSpeed's default gradient clipping (1.0) on both sides


def _engine(ep, stage):
    import torch.distributed as dist

    import zerotron

    config = {
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": stage, "stage3_gather_16bit_weights_on_model_save": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
    }
    engine, *_ = zerotron.initialize(model=TinyMoE(ep, dist.get_rank() % ep), config=config)
    return engine


def _save(directory, ep, stage):
    import torch.distributed as dist

    engine, rank = _engine(ep, stage), dist.get_rank()
    for b in batches(STEPS, dist.get_world_size())[:2]:
        engine.backward(engine(b[rank : rank + 1, :-1], b[rank : rank + 1, 1:]))
        engine.step()
    engine.save_checkpoint(directory / "ckpt")
    engine.save_16bit_model(directory / "whole")


def _resume(directory, ep, stage):
    import torch.distributed as dist

    engine = _engine(ep, stage)
    engine.load_checkpoint(directory / "ckpt")
    rank, world, losses = dist.get_rank(), dist.get_world_size(), []
    for b in batches(STEPS, world)[2:]:
        loss = engine(b[rank : rank + 1, :-1], b[rank : rank + 1, 1:])
        engine.backward(loss)
        engine.step()
        losses.append(engine._mean_over_dp(loss.detach()).item())
    engine.save_16bit_model(directory / "resumed")
    return losses


CASES = [  # world, (ep, ZeRO stage) saved, (ep, ZeRO stage) resumed
    (2, (2, 1), (1, 3)),
    (2, (1, 2), (2, 0)),
    (4, (4, 2), (2, 3)),
]


@pytest.mark.parametrize("world,saved,resumed", CASES)
def test_saved_at_one_expert_parallel_size_resumes_at_another(tmp_path, world, saved, resumed):
    from zerotron.checkpoint.export import convert

    run_ranks(_save, world, tmp_path, *saved, timeout=120)
    _, after_two = reference(2, world, 2, True, 1.0)
    want_losses, want = reference(STEPS, world, 2, True, 1.0)
    converted = convert(tmp_path / "ckpt", tmp_path / "converted")
    whole = load_file(tmp_path / "whole" / "model.safetensors")
    for name, state in (("save_16bit_model", whole), ("convert", load_file(converted))):
        assert sorted(state) == sorted(after_two), name
        assert max((state[n] - after_two[n]).abs().max().item() for n in state) < 1e-5, name
    for losses in run_ranks(_resume, world, tmp_path, *resumed, timeout=120):
        assert max(abs(a - b) / b for a, b in zip(losses, want_losses[2:])) < 1e-6, (losses, want_losses)
    whole = load_file(tmp_path / "resumed" / "model.safetensors")
    assert max((whole[n] - want[n]).abs().max().item() for n in want) < 1e-5
    one_process = TinyMoE()
    one_process.load_state_dict(whole)  # every key, none missing: the one-process model's own names
