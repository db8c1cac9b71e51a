"""tools/gpu, the GPU runbooks: the one-GPU runbook in its CPU smoke mode (every part's code path on a tiny
model), the GPU side of its checks on a fake GPU (tools/fake_cuda), the multi-GPU layouts on gloo ranks, the
verdict and the time limits, and the arithmetic that sizes the offload part on the GPU machine."""

import json
import math
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from distributed import run_ranks  # noqa: E402

from tools.gpu import device, sizing  # noqa: E402
from tools.gpu.checks import all_passed  # noqa: E402

GiB = 1 << 30


def test_smoke_run_prints_and_writes_every_part(tmp_path):
    out = tmp_path / "gpu.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    run = subprocess.run(
        [sys.executable, "-m", "tools.gpu", "--smoke", "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=420,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "tools/gpu summary (smoke (CPU))" in run.stdout
    for marker in ("[0] correctness", "[1] MFU", "[2] offload", "[3] activation checkpointing"):
        assert marker in run.stdout, marker

    result = json.loads(out.read_text())
    jobs = result["jobs"]
    assert set(jobs) == {"correct", "mfu", "ckpt", "offload", "offload_off", "sanitized"}
    assert jobs["sanitized"]["all_ok"] and list(jobs["sanitized"]["zero_parity"]) == ["offload_param_zero3"]
    correct = jobs["correct"]
    assert correct["all_ok"], correct
    assert len(correct["zero_parity"]) == 11 and all(v["ok"] for v in correct["zero_parity"].values())
    assert correct["overflow"]["bf16"]["ok"] and correct["checkpoint_round_trip"]["ok"]
    assert "skipped" in correct["host_syncs"] and "skipped" in correct["moe_host_syncs"]  # (none on a CPU)
    for check in ("bf16_offload", "ring_attention_bf16", "moe_grouped_bf16"):
        assert correct[check] and all_passed(correct[check]), (check, correct[check])
    for name, job in jobs.items():
        assert not job.get("error") and not job.get("skipped"), (name, job)
        assert job["device"]["type"] == "cpu"

    mfu = jobs["mfu"]
    assert set(mfu["systems"]) == {"zerotron", "plain", "plain_autocast"}
    for name, r in mfu["systems"].items():
        assert "error" not in r, (name, r)
        assert r["median_s"] > 0 and r["tokens_per_s"] > 0 and len(r["step_s"]) == 2
        assert all(math.isfinite(v) and 4.5 < v < 6.5 for v in r["losses"]), r["losses"]  # ~ln 256
    # Same seed, same bf16 weights, same fp32-master fused AdamW: the same losses.
    assert mfu["zerotron_vs_plain"]["max_abs_dloss"] < 1e-2
    assert mfu["systems"]["zerotron"]["memory_report_gib"]["master_weights"] > 0

    assert set(jobs["ckpt"]["policies"]) == {"none", "every_block", "selective"}
    assert all(r["median_s"] > 0 for r in jobs["ckpt"]["policies"].values())

    off = jobs["offload"]
    psi = off["model"]["params"]
    assert off["assessment"]["fits_host_with_offload"] is True and off["layers"] == off["model"]["n_layer"]
    assert len(off["steps"]) == 2 and off["tokens_per_s"] > 0
    host = off["memory_report_gib"]["host"] * GiB
    # fp32 masters + bf16 staging + two fp32 moments (+ AdamW's step counters): the gradients arrive in the
    # staging buffer and CPU Adam reads them there, so no fp32 gradient buffer
    assert abs(host - 14 * psi) < 0.01 * 14 * psi, (host, 14 * psi)
    assert jobs["offload_off"]["outcome"] == "fits"  # no device memory limit on a CPU
    assert jobs["offload_off"]["micro_batch"] == off["micro_batch"]


def _checks_on_a_fake_gpu():
    import torch

    from tools.gpu import checks, moe_ring

    device = torch.device("cuda", 0)
    checks_of = (checks.host_syncs, checks.bf16_offload, moe_ring.ring_autograd, moe_ring.moe_grouped,
                 moe_ring.moe_host_syncs)  # fmt: skip
    return {check.__name__: check(device) for check in checks_of}


def test_the_runbooks_gpu_branches_on_a_fake_gpu():
    """What the smoke run cannot reach: the checks' GPU side (host syncs from torch.cuda.set_sync_debug_mode,
    CUDA's attention kernels through ring attention's autograd function, the bf16 grouped matrix multiply, bf16
    offload on a device) on a fake GPU (tools/fake_cuda)."""
    result = run_ranks(_checks_on_a_fake_gpu, 1, fake_cuda=True, timeout=180)[0]
    assert all_passed(result), result
    assert result["host_syncs"]["count"] == 2 and result["moe_host_syncs"]["count"] == 6, result


def _multi_gpu_runbook(out):
    from tools.gpu import multi

    return multi.main(["--smoke", "--out", str(out)])


def test_the_multi_gpu_runbook_on_cpu_ranks(tmp_path):
    """tools/gpu/multi.py's layouts (what only several GPUs show) on 2 gloo ranks: each matches one process."""
    assert run_ranks(_multi_gpu_runbook, 2, tmp_path / "multi.json", timeout=180) == [0, 0]
    layouts = json.loads((tmp_path / "multi.json").read_text())["layouts"]
    assert len(layouts) == 10 and all(v["ok"] for v in layouts.values()), layouts


def test_a_failed_check_fails_the_run_and_the_limits_fit_the_budget():
    from tools.gpu import run

    jobs = {"correct": {"all_ok": False}, "mfu": {"systems": {}}, "offload": {"error": "killed"}, "ckpt": {}}
    assert run.failed_parts({"jobs": jobs}) == ["correct", "offload"]
    # every part in its turn within 8 minutes, even if one runs into its grace period
    assert sum(run.JOB_LIMITS.values()) + run.GRACE_S <= run.GPU["time_budget"] - 20


def test_offload_arithmetic():
    assert sizing.pinned_bytes(1) == 1 and sizing.pinned_bytes(4096) == 4096 and sizing.pinned_bytes(4097) == 8192
    psi = 10**9
    assert sizing.offload_host_bytes(psi) == 4 * GiB + 2 * GiB + 8 * psi  # 4e9 B -> 4 GiB, 2e9 B -> 2 GiB
    assert sizing.states_bytes_without_offload(psi) == (16 * psi, 20 * psi)
    assert sizing.choose_micro_batch(base=10 * GiB, per_sample=5 * GiB, capacity=100 * GiB, fraction=0.85, cap=32) == 15
    assert sizing.choose_micro_batch(base=10 * GiB, per_sample=5 * GiB, capacity=100 * GiB, fraction=0.85, cap=8) == 8
    assert sizing.choose_micro_batch(base=90 * GiB, per_sample=5 * GiB, capacity=100 * GiB, fraction=0.85, cap=8) == 1
    assert sizing.choose_micro_batch(base=1, per_sample=0, capacity=100, fraction=0.85, cap=8) is None


def test_parameter_count_matches_the_model():
    """tools/gpu counts parameters from the config (building a 13b, even on the meta device, is slow)."""
    from dataclasses import replace

    import torch

    from zerotron.models.gpt import GPT, SIZES, config_for

    # Every shape with two blocks (the count is per block; more blocks only cost time on the meta device).
    cases = [replace(config_for(size), n_layer=2) for size in SIZES]
    cases.append(replace(config_for("small"), tie_embeddings=True))
    for cfg in cases:
        with torch.device("meta"):
            model = GPT(cfg)
        total, per_layer, fixed = device.param_counts(cfg)
        assert total == model.num_params() and fixed + cfg.n_layer * per_layer == total, cfg
        assert device.flops_per_token(cfg, 2048) == model.flops_per_token(2048), cfg


def test_offload_plan_for_13b_on_the_h200_machine():
    """What the GPU run will do with the defaults: 13b fits neither the GPU without offload nor 128 GiB of
    host memory with it, so it trains 27 of the 40 layers (8.57B parameters: 14 host bytes each)."""
    from zerotron.models.gpt import config_for

    cfg = config_for("13b", max_seq_len=2048)
    psi, per_layer, fixed = device.param_counts(cfg)
    assert 12.6e9 < psi < 12.8e9
    assert sizing.states_bytes_without_offload(psi)[0] > 139 * GiB
    assert sizing.offload_host_bytes(psi) > 128 * GiB
    layers = sizing.pick_layers(fixed, per_layer, cfg.n_layer, (128 - 16) * GiB)
    assert layers == 27
    assert sizing.offload_host_bytes(fixed + layers * per_layer) < 112 * GiB


def test_the_self_check_verdict_reads_every_nested_check():
    from tools.gpu.checks import all_passed

    passing = {
        "zero_parity": {"zero2_gas1": {"ok": True}},
        "overflow": {"fp16": {"ok": True}, "bf16": {"ok": True}},
        "launch_blocking_rerun": {"skipped": "CUDA only"},
        "host_syncs": {"ok": True, "count": 1},
    }
    assert all_passed(passing)
    failing = {**passing, "overflow": {"fp16": {"ok": False, "loss_scale": [65536.0, 65536.0]}, "bf16": {"ok": True}}}
    assert not all_passed(failing)  # a real overflow bug is not "all checks passed"
    assert not all_passed({**passing, "checkpoint_round_trip": {"ok": False}})


def test_the_overflow_check_expects_what_the_engines_scaler_does():
    """One fp16 overflow at the default hysteresis (2) spends the grace and keeps the scale; at
    hysteresis 1 it halves it: the check's expectation is the engine's scaler's."""
    from tools.gpu.checks import scale_after_one_overflow
    from zerotron.config import FP16Config
    from zerotron.precision import LossScaler

    for hysteresis in (1, 2, 3):
        scaler = LossScaler(FP16Config(enabled=True, hysteresis=hysteresis))
        before = scaler.scale
        scaler.update(True)
        assert scaler.scale == scale_after_one_overflow(before, hysteresis)
    assert scale_after_one_overflow(65536.0, FP16Config().hysteresis) == 65536.0  # the default: no halving
