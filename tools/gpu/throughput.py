"""The GPU runbook's `mfu` and `ckpt` parts: zerotron next to plain PyTorch loops doing the same math (bf16 with
fp32 masters; torch's AMP), and activation checkpointing policies; each case timed on a fresh model (measure):
tokens/s, MFU, peak memory."""

from __future__ import annotations

import math
import statistics
import time
import traceback

import torch

from tools import training
from tools.gpu.device import ADAMW, build_model, describe_error, log, model_info, zerotron_engine
from tools.gpu.sizing import gib


def plain_bf16(model, clip: float):
    """Plain PyTorch doing what zerotron does: bf16 model, fp32 master copies, fused AdamW on the masters."""
    params = [p for p in model.parameters() if p.requires_grad]
    masters = [torch.nn.Parameter(p.detach().float()) for p in params]
    for m in masters:
        m.grad = torch.zeros_like(m)
    opt = torch.optim.AdamW(masters, fused=True, **ADAMW)

    def step(x, y):
        loss = model(x, y)
        loss.backward()
        with torch.no_grad():
            torch._foreach_copy_([m.grad for m in masters], [p.grad for p in params])
            if clip > 0:
                torch.nn.utils.clip_grad_norm_(masters, clip, foreach=True)
            opt.step()
            torch._foreach_copy_(params, masters)
        for p in params:
            p.grad = None
        return loss.item()

    return opt, step


def plain_autocast(model, clip: float):
    """torch's usual AMP recipe: fp32 parameters (the masters), bf16 matmuls under autocast."""
    model.float()
    opt = torch.optim.AdamW(model.parameters(), fused=True, **ADAMW)
    device_type = next(model.parameters()).device.type
    return opt, training.torch_step(
        model, opt, clip, autocast=lambda: torch.autocast(device_type, dtype=torch.bfloat16), foreach=True
    )


def timed(step, batches, warmup: int, steps: int, dev, deadline: float) -> dict:
    """`warmup` untimed steps, then up to `steps` timed ones (each between synchronizations), stopping early
    near the deadline. Memory: what stays allocated between steps (model states) and the peak over the
    timed steps."""
    losses = []
    dev.reset_peak()
    for i in range(warmup):
        losses.append(step(*batches[i]))
    dev.sync()
    out = {"peak_incl_warmup_gib": gib(dev.peak()), "between_steps_gib": gib(dev.allocated())}
    dev.reset_peak()
    times = []
    for i in range(warmup, warmup + steps):
        if times and time.time() + statistics.median(times) > deadline - 10:
            out["stopped_early"] = f"time limit after {len(times)} timed steps"
            break
        dev.sync()
        t = time.perf_counter()
        losses.append(step(*batches[i]))
        dev.sync()
        times.append(time.perf_counter() - t)
    out.update(
        step_s=times,
        median_s=statistics.median(times),
        mean_s=statistics.mean(times),
        losses=losses,
        peak_gib=gib(dev.peak()),
    )
    if out["peak_gib"] is not None and out["between_steps_gib"] is not None:
        out["activations_gib"] = out["peak_gib"] - out["between_steps_gib"]
    if not all(math.isfinite(v) for v in losses):
        out["warning"] = "non-finite loss"
    return out


def add_rates(r: dict, tokens_per_step: int, fpt: float, peak_flops: float | None) -> dict:
    r["tokens_per_s"] = tokens_per_step / r["median_s"]
    r["mfu"] = fpt * r["tokens_per_s"] / peak_flops if peak_flops else None
    return r


def measure(part: str, cases, cfg, b: int, args, dev, result, out: dict, save, make) -> None:
    """For each case, a fresh model and `make(case, model) -> (engine or optimizer, step)`, then timed():
    tokens/s, MFU, memory; out[case] is saved as soon as it is measured, an exception recorded as its error."""
    batches = training.make_batches(args.warmup + args.steps, b, args.seq, cfg.vocab_size, device=dev.device)
    for case in cases:
        try:
            t = time.perf_counter()
            engine, step = make(case, build_model(cfg, dev))
            setup = time.perf_counter() - t
            r = add_rates(
                timed(step, batches, args.warmup, args.steps, dev, args.deadline),
                b * args.seq,
                result["model"]["flops_per_token"],
                result["peak_flops"],
            )
            r["setup_s"] = setup
            if hasattr(engine, "memory_report"):
                r["memory_report_gib"] = {k: gib(v) for k, v in engine.memory_report().items()}
            log(
                f"{part}: {case}: median {r['median_s'] * 1e3:.1f} ms/step, {r['tokens_per_s']:,.0f} tokens/s"
                + (f", MFU {r['mfu']:.1%}" if r["mfu"] else "")
                + (
                    f", peak {r['peak_gib']:.2f} GiB (activations {r['activations_gib']:.2f})"
                    if r["peak_gib"] is not None
                    else ""
                )
                + f", losses {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}"
            )
        except Exception as e:  # noqa: BLE001 - one case failing must not lose the others
            traceback.print_exc()
            r = {"error": describe_error(e)}
            log(f"{part}: {case}: FAILED: {r['error']}")
        out[case] = r
        engine = step = None
        dev.free()
        save()


def job_mfu(args, dev, result, save):
    from zerotron.models.gpt import config_for

    cfg = config_for(args.mfu_model, max_seq_len=args.seq)
    result["model"] = info = model_info(args.mfu_model, cfg, args.seq)
    b = args.micro_batch
    result.update(micro_batch=b, tokens_per_step=b * args.seq, peak_flops=dev.peak_flops(), clip=args.clip, systems={})
    log(
        f"mfu: {args.mfu_model} GPT, {info['params'] / 1e9:.3f}B params, {b} x {args.seq} tokens/step, "
        f"{args.warmup} warm-up + {args.steps} timed steps per system"
    )
    makers = {
        "zerotron": lambda m: zerotron_engine(m, b, args.clip),
        "plain": lambda m: plain_bf16(m, args.clip),
        "plain_autocast": lambda m: plain_autocast(m, args.clip),
    }
    measure("mfu", args.systems, cfg, b, args, dev, result, result["systems"], save, lambda n, m: makers[n](m))
    zt, pl = result["systems"].get("zerotron", {}), result["systems"].get("plain", {})
    if "median_s" in zt and "median_s" in pl:
        n = min(len(zt["losses"]), len(pl["losses"]))
        result["zerotron_vs_plain"] = {
            "step_time_ratio": zt["median_s"] / pl["median_s"],
            "peak_memory_ratio": zt["peak_gib"] / pl["peak_gib"] if zt["peak_gib"] and pl["peak_gib"] else None,
            "max_abs_dloss": max(abs(a - c) for a, c in zip(zt["losses"][:n], pl["losses"][:n])),
        }


def job_ckpt(args, dev, result, save):
    from zerotron.models.gpt import config_for

    cfg = config_for(args.ckpt_model, max_seq_len=args.seq)
    result["model"] = info = model_info(args.ckpt_model, cfg, args.seq)
    b = args.ckpt_micro_batch
    result.update(micro_batch=b, tokens_per_step=b * args.seq, peak_flops=dev.peak_flops(), policies={})
    log(
        f"ckpt: {args.ckpt_model} GPT, {info['params'] / 1e6:.0f}M params, {b} x {args.seq} tokens/step, "
        f"policies {', '.join(args.ckpt_policies)}"
    )
    measure(
        "ckpt",
        args.ckpt_policies,
        cfg,
        b,
        args,
        dev,
        result,
        result["policies"],
        save,
        lambda policy, m: zerotron_engine(m, b, args.clip, zerotron={"checkpoint_policy": policy}),
    )
    base = result["policies"].get("none", {})
    for policy, r in result["policies"].items():
        if "median_s" in r and "median_s" in base:
            r["step_time_vs_none"] = r["median_s"] / base["median_s"]
            if r.get("peak_gib") and base.get("peak_gib"):
                r["peak_vs_none"] = r["peak_gib"] / base["peak_gib"]
