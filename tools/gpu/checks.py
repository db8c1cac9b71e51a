"""The GPU runbook's `correct` part (tools/gpu/run.py): the correctness checks one GPU allows (one process,
a world of one).

- ZeRO 0-3 x accumulation 1-2, fp32 with deterministic kernels, against a plain PyTorch loop
  (the same fused AdamW): each step's loss within 1e-5 relative, final weights within 1e-5;
- optimizer offload (pinned and not, stage 2) and ZeRO-3 parameter offload, the same way;
- fp16 with an inf forced into one gradient (the step is skipped, the loss scale halves) and bf16
  with a NaN (the step is skipped): the weights stay as they were;
- a checkpoint round trip: save after 2 steps, load into a fresh engine, the next steps are
  bit-identical to an uninterrupted run;
- the ZeRO checks rerun under CUDA_LAUNCH_BLOCKING=1 and compared bit for bit (a race between
  streams shows as a difference);
- bf16 with optimizer offload (ZeRO-2) and parameter offload (ZeRO-3) against bf16 without offload;
- the host syncs of one training step, from `torch.cuda.set_sync_debug_mode("warn")` (a CPU has none:
  tests/test_fake_cuda.py counts them on a fake GPU);
- ring attention, the MoE GPT's grouped matrix multiply and its host syncs: tools/gpu/moe_ring.py.

Runs on torch 2.11 and later (the GPU machine's), on CUDA or, in the smoke run, on the CPU.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
from tools import training  # noqa: E402
from tools.gpu import moe_ring  # noqa: E402

STEPS, SEQ, MICRO = 4, 64, 4
ADAMW = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-6, "weight_decay": 0.1}


def _model(device, **overrides):
    import torch

    from zerotron.models.gpt import GPT, config_for

    torch.manual_seed(0)
    return GPT(config_for("tiny", max_seq_len=SEQ, **overrides)).to(device)


def _batches(device, n=STEPS, rows=2 * MICRO):
    return [(x.to(device), y.to(device)) for x, y in training.make_batches(n, rows, SEQ, 256, seed=1)]


def _reference(device):
    import torch

    model = _model(device)
    opt = torch.optim.AdamW(model.parameters(), fused=True, **ADAMW)
    step = training.torch_step(model, opt, clip=1.0)
    losses = [step(x, y) for x, y in _batches(device)]
    return losses, {k: v.detach().float().cpu() for k, v in model.state_dict().items()}


def _engine(device, stage, gas, dtype="fp32", **zero):
    import zerotron

    config = training.zerotron_config(
        2 * MICRO // gas,
        1.0,
        adamw=ADAMW,
        gas=gas,
        zero_optimization={"stage": stage, "stage3_param_persistence_threshold": 0, **zero},
    )
    if dtype != "fp32":
        config[dtype] = {"enabled": True}
    engine, *_ = zerotron.initialize(model=_model(device), config=config)
    return engine


def _train(engine, batches):
    gas = engine.gradient_accumulation_steps()
    return [engine.train_batch(iter(list(zip(x.chunk(gas), y.chunk(gas))))).item() for x, y in batches]


def _compare(losses, weights, ref_losses, ref_weights) -> dict:
    loss_rel = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    weight = max((weights[k] - ref_weights[k]).abs().max().item() for k in ref_weights)
    return {"max_loss_rel": loss_rel, "max_weight_diff": weight, "ok": loss_rel <= 1e-5 and weight <= 1e-5}


def _weights(engine):
    import zerotron

    return {k: v.float().cpu() for k, v in zerotron.zero.consolidated_state_dict(engine.module).items()}


def _digest(weights) -> str:
    h = hashlib.sha256()
    for k in sorted(weights):
        h.update(k.encode())
        h.update(weights[k].numpy().tobytes())
    return h.hexdigest()[:16]


def zero_parity(device, names=None) -> dict:
    """ZeRO 0-3 x accumulation 1-2 and the offload variants (or those `names`) against the plain loop."""
    ref_losses, ref_weights = _reference(device)
    cases = {f"zero{stage}_gas{gas}": (stage, gas, {}) for stage in range(4) for gas in (1, 2)}
    cases.update(
        {
            "offload_optimizer_pinned_zero2": (2, 1, {"offload_optimizer": {"device": "cpu", "pin_memory": True}}),
            "offload_optimizer_zero2": (2, 1, {"offload_optimizer": {"device": "cpu", "pin_memory": False}}),
            "offload_param_zero3": (
                3,
                1,
                {
                    "offload_param": {"device": "cpu", "pin_memory": True},
                    "offload_optimizer": {"device": "cpu", "pin_memory": True},
                },
            ),
        }
    )
    out = {}
    for name, (stage, gas, zero) in cases.items():
        if names is not None and name not in names:
            continue
        try:
            engine = _engine(device, stage, gas, **zero)
            losses = _train(engine, _batches(device))
            weights = _weights(engine)
            out[name] = {**_compare(losses, weights, ref_losses, ref_weights), "digest": _digest(weights)}
        except Exception as e:  # noqa: BLE001 - one case failing is a finding, the others still run
            out[name] = {
                "ok": False,
                "error": f"{type(e).__name__}: {str(e)[:300]}",
                "trace": traceback.format_exc()[-800:],
            }
    return out


def overflow(device) -> dict:
    """One gradient set to inf (fp16) or NaN (bf16) in step 2: skipped, weights untouched."""
    import torch

    out = {}
    for dtype, bad in (("fp16", float("inf")), ("bf16", float("nan"))):
        if dtype == "fp16" and device.type == "cpu":
            out[dtype] = {"skipped": "fp16 training needs a GPU"}
            continue
        engine = _engine(device, 2, 1, dtype)
        batches = _batches(device, 3)
        _train(engine, batches[:1])
        before = _weights(engine)
        scale = engine.loss_scale
        param = next(p for p in engine.module.parameters() if p.requires_grad)
        hook = param.register_hook(lambda g: torch.full_like(g, bad))
        _train(engine, batches[1:2])
        hook.remove()
        after = _weights(engine)
        unchanged = all(torch.equal(before[k], after[k]) for k in before)
        expected = scale_after_one_overflow(scale, engine.config.fp16.hysteresis)
        out[dtype] = {
            "skipped_steps": engine.skipped_steps,
            "weights_unchanged": unchanged,
            "loss_scale": [scale, engine.loss_scale],
            "hysteresis": engine.config.fp16.hysteresis,
            "ok": unchanged and engine.skipped_steps == 1 and (dtype != "fp16" or engine.loss_scale == expected),
        }
        _train(engine, batches[2:])  # and training goes on
    return out


def scale_after_one_overflow(scale: float, hysteresis: int) -> float:
    """DeepSpeed's dynamic scaler: an overflow halves the scale only once `hysteresis` overflows have
    used up their grace (the default 2: the first overflow leaves the scale as it is)."""
    return scale / 2 if hysteresis <= 1 else scale


def checkpoint_round_trip(device) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        straight = _engine(device, 2, 2)
        want = _train(straight, _batches(device))
        first = _engine(device, 2, 2)
        _train(first, _batches(device)[:2])
        first.save_checkpoint(tmp)
        resumed = _engine(device, 2, 2)
        resumed.load_checkpoint(tmp)
        got = _train(resumed, _batches(device)[2:])
        same_weights = _digest(_weights(resumed)) == _digest(_weights(straight))
    return {
        "losses_bit_identical": got == want[2:],
        "weights_bit_identical": same_weights,
        "ok": got == want[2:] and same_weights,
    }


def host_syncs(device) -> dict:
    """The host syncs of one ZeRO-2 training step after warm-up: the step's agreement and the loss read."""
    from tools.gpu.device import host_syncs as count

    batches = _batches(device, 2)
    return count(_engine(device, 2, 2), _train, batches[:1], batches[1:], budget=2)


def bf16_offload(device) -> dict:
    """bf16 with optimizer offload (ZeRO-2) and with parameter offload (ZeRO-3) against bf16 ZeRO-2 without: the
    same fp32 masters and AdamW arithmetic on the host as on the device, so the losses agree to the bf16 weights'
    rounding (1e-3 relative) and the weights to a bf16 rounding step."""
    pinned = {"device": "cpu", "pin_memory": True}
    want = _train(_engine(device, 2, 1, "bf16"), _batches(device))
    out = {}
    for name, stage, zero in (
        ("offload_optimizer_zero2_bf16", 2, {"offload_optimizer": pinned}),
        ("offload_param_zero3_bf16", 3, {"offload_optimizer": pinned, "offload_param": pinned}),
    ):
        try:
            engine = _engine(device, stage, 1, "bf16", **zero)
            got = _train(engine, _batches(device))
            worst = max(abs(a - b) / abs(b) for a, b in zip(got, want))
            out[name] = {"losses": got, "reference": want, "max_loss_rel": worst, "ok": worst <= 1e-3}
        except Exception as e:  # noqa: BLE001 - one case failing is a finding, the others still run
            out[name] = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:300]}"}
    return out


def job_correct(args, dev, result, save):
    import torch

    device = dev.device
    if device.type == "cuda":  # deterministic kernels: two runs of the same math give the same bits
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    for name, check in (
        ("zero_parity", zero_parity),
        ("overflow", overflow),
        ("checkpoint_round_trip", checkpoint_round_trip),
        ("host_syncs", host_syncs),
        ("bf16_offload", bf16_offload),
        ("ring_attention_bf16", moe_ring.ring_autograd),
        ("moe_grouped_bf16", moe_ring.moe_grouped),
        ("moe_host_syncs", moe_ring.moe_host_syncs),
    ):
        try:
            result[name] = check(device)
        except Exception as e:  # noqa: BLE001
            result[name] = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:300]}"}
        save()
    if device.type == "cuda" and not os.environ.get("CUDA_LAUNCH_BLOCKING"):
        result["launch_blocking_rerun"] = _rerun_blocking(args, result)
    else:
        result["launch_blocking_rerun"] = {"skipped": "CUDA only" if device.type != "cuda" else "this is the rerun"}
    result["all_ok"] = all_passed(result)
    save()


def all_passed(result) -> bool:
    """Every check's verdict, however deep it sits (overflow's per-dtype, zero_parity's per-case):
    one "ok": false anywhere fails the whole."""
    if isinstance(result, dict):
        return result.get("ok", True) is not False and all(all_passed(v) for k, v in result.items() if k != "ok")
    return True


def job_sanitized(args, dev, result, save):
    """The ZeRO/offload parity cases under torch's CUDA sanitizer (TORCH_CUDA_SANITIZER=1, set by the
    parent for this part): an unsynchronized access between streams raises and fails its case."""
    cuda = dev.device.type == "cuda"
    result["sanitizer"] = os.environ.get("TORCH_CUDA_SANITIZER") == "1"  # (a CPU build of torch refuses it)
    # (on a CPU, with no streams to race and no sanitizer, one case runs the code path)
    result["zero_parity"] = zero_parity(dev.device, None if cuda else ["offload_param_zero3"])
    result["all_ok"] = (result["sanitizer"] or not cuda) and all_passed(result["zero_parity"])
    save()


def _rerun_blocking(args, result) -> dict:
    """The ZeRO checks again with every kernel launch synchronous; digests compared bit for bit."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rerun.json"
        env = {**os.environ, "CUDA_LAUNCH_BLOCKING": "1"}
        code = (
            "import sys, json; sys.path.insert(0, %r); from tools.gpu import checks; import torch; "
            "torch.use_deterministic_algorithms(True, warn_only=True); torch.backends.cuda.matmul.allow_tf32 = False; "
            "json.dump(checks.zero_parity(torch.device('cuda', 0)), open(%r, 'w'))"
        ) % (str(ROOT), str(out))
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            return {"ok": False, "error": proc.stderr[-800:]}
        rerun = json.loads(out.read_text())
    first = result.get("zero_parity", {})
    differ = [k for k in first if first[k].get("digest") != rerun.get(k, {}).get("digest")]
    return {"ok": not differ, "differing": differ}
