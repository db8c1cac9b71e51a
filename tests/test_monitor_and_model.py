"""Monitors write what DeepSpeed's do; the reference model's parts behave as designed."""

import csv
import os

import torch
import torch.distributed as dist
from distributed import run_ranks
from parity import ds_config, global_batches, make_model, micro_batches

import zerotron
from zerotron.models.gpt import GPT, apply_rotary, config_for, rotary_tables


def _monitored(out_dir):
    dp, rank = dist.get_world_size(), dist.get_rank()
    config = ds_config(
        2,
        1,
        csv_monitor={"enabled": True, "output_path": out_dir, "job_name": "job"},
        tensorboard={"enabled": True, "output_path": out_dir, "job_name": "tb"},
    )
    engine, *_ = zerotron.initialize(model=make_model(), config=config)
    losses = [engine.train_batch(iter(micro_batches(b, rank, dp, 1))).item() for b in global_batches(3, 2 * dp)]
    engine.monitor.close()
    return losses


def test_csv_and_tensorboard_monitors(tmp_path):
    losses = run_ranks(_monitored, 2, str(tmp_path))[0]
    with open(tmp_path / "job" / "Train_Samples_train_loss.csv") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["step", "Train/Samples/train_loss"]
    # x-axis: samples seen after the step, as DeepSpeed counts them; value: rank 0's mean loss
    assert [int(r[0]) for r in rows[1:]] == [4, 8, 12]
    assert len(rows) == 4 and all(float(r[1]) > 0 for r in rows[1:])
    assert (tmp_path / "job" / "Train_Samples_lr.csv").exists()
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(tmp_path / "tb"))
    assert len(losses) == 3


def test_rotary_preserves_norms_and_relative_positions():
    cfg = config_for("tiny", max_seq_len=32)
    cos, sin = rotary_tables(cfg, 32)
    q = torch.randn(1, 1, 32, cfg.head_dim)
    k = torch.randn(1, 1, 32, cfg.head_dim)
    rq, rk = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    torch.testing.assert_close(rq.norm(dim=-1), q.norm(dim=-1))
    # the same vectors at positions (3, 7) and (13, 17) give the same score: only offsets matter
    same_q, same_k = q[:, :, 3:4].expand(1, 1, 32, -1), k[:, :, 7:8].expand(1, 1, 32, -1)
    rq, rk = apply_rotary(same_q, cos, sin), apply_rotary(same_k, cos, sin)
    torch.testing.assert_close((rq[0, 0, 3] * rk[0, 0, 7]).sum(), (rq[0, 0, 13] * rk[0, 0, 17]).sum())


def test_causal_grouped_query_attention_and_generation():
    torch.manual_seed(0)
    model = GPT(config_for("tiny", max_seq_len=16))
    assert model.config.n_kv_head < model.config.n_head
    tokens = torch.randint(0, 256, (2, 16))
    logits = model(tokens)
    changed = tokens.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 256
    # a change at position 10 never affects earlier positions' logits
    torch.testing.assert_close(model(changed)[:, :10], logits[:, :10])
    out = model.generate(tokens[:, :4], 20, top_k=5, generator=torch.Generator().manual_seed(0))
    assert out.shape == (2, 24) and torch.equal(out[:, :4], tokens[:, :4])
    assert model.flops_per_token(16) == 6 * (model.num_params() - 256 * 64) + 12 * 2 * 64 * 16
