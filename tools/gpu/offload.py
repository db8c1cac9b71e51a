"""The GPU runbook's `offload` part (ZeRO-Offload: the memory arithmetic of --offload-model against GPU and host
memory, then as many of its layers as the host holds at the largest micro-batch that fits) and `offload_off`
(the same without offload: out of memory expected)."""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import replace

from tools import training
from tools.gpu.device import (
    build_model,
    describe_error,
    host_peak_rss,
    host_total_bytes,
    is_oom,
    log,
    model_info,
    param_counts,
    zerotron_engine,
)
from tools.gpu.sizing import GiB, choose_micro_batch, gib, offload_host_bytes, pick_layers, states_bytes_without_offload


# ---- part 2: offload ---------------------------------------------------------------------------------
def offload_sections(args, offload: bool) -> dict:
    zero = {"stage": args.offload_stage}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
        if args.offload_stage == 3:
            zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    return {"zero_optimization": zero}


def offload_model_cfg(args, dev, result):
    """The assessment of --offload-model and the config actually trained (maybe fewer layers)."""
    from zerotron.models.gpt import config_for

    full = config_for(args.offload_model, max_seq_len=args.seq)
    psi, per_layer, fixed = param_counts(full)
    gpu_total, host_total = dev.total(), host_total_bytes(args, dev)
    host_budget = host_total - int(args.host_reserve_gib * GiB)
    persistent, step_peak = states_bytes_without_offload(psi)
    host = offload_host_bytes(psi)
    result["assessment"] = a = {
        "model": args.offload_model,
        "params": psi,
        "gpu_total_gib": gib(gpu_total),
        "host_gib": gib(host_total),
        "host_budget_gib": gib(host_budget),
        "gpu_states_without_offload_gib": gib(persistent),
        "gpu_states_step_peak_without_offload_gib": gib(step_peak),
        "fits_gpu_without_offload": None if gpu_total is None else persistent < gpu_total,
        "gpu_states_with_offload_gib": gib(4 * psi),
        "host_with_offload_gib": gib(host),
        "host_with_offload_unrounded_gib": gib(14 * psi),
        "fits_host_with_offload": host <= host_budget,
    }
    if args.offload_layers == "auto":
        layers = (
            full.n_layer if a["fits_host_with_offload"] else pick_layers(fixed, per_layer, full.n_layer, host_budget)
        )
        if layers == 0:
            raise RuntimeError(
                f"not even one layer of {args.offload_model} fits {gib(host_budget):.0f} GiB of host "
                "memory with offload"
            )
    else:
        layers = int(args.offload_layers)
    cfg = replace(full, n_layer=layers)
    log(
        f"offload: {args.offload_model}: {psi / 1e9:.2f}B params; without offload its model states need "
        f"{gib(persistent):.0f} GiB on the GPU (16 B/param; {gib(step_peak):.0f} at the step)"
        + (
            f" of {gib(gpu_total):.1f}: {'fits' if a['fits_gpu_without_offload'] else 'does NOT fit'}"
            if gpu_total
            else ""
        )
        + f"; with offload {gib(host):.0f} GiB of host memory (pinned blocks rounded to powers of two) of a "
        f"{gib(host_budget):.0f} GiB budget: {'fits' if a['fits_host_with_offload'] else 'does NOT fit'}"
    )
    if layers != full.n_layer:
        log(f"offload: training its shape with {layers} of {full.n_layer} layers instead")
    return cfg, layers


def job_offload(args, dev, result, save):
    if dev.cuda:  # CPUAdam's thread pool takes torch's thread count, which OMP_NUM_THREADS may have set low
        dev.torch.set_num_threads(args.cpu_threads or os.cpu_count() or 1)
        result["cpu_threads"] = dev.torch.get_num_threads()
    cfg, layers = offload_model_cfg(args, dev, result)
    result["layers"] = layers
    result["model"] = info = model_info(args.offload_model, cfg, args.seq)
    psi = info["params"]
    result.update(
        stage=args.offload_stage, host_bytes_formula_gib=gib(offload_host_bytes(psi)), peak_flops=dev.peak_flops()
    )
    save()

    def build():
        t = time.perf_counter()
        model = build_model(cfg, dev, meta_init=args.offload_stage == 3)
        engine, step = zerotron_engine(model, 1, args.clip, **offload_sections(args, offload=True))
        return engine, time.perf_counter() - t

    log(
        f"offload: building {psi / 1e9:.2f}B params in bf16 on {dev.device.type}, stage {args.offload_stage} + "
        "offload_optimizer (pinned host buffers)"
    )
    engine, setup = build()
    result["setup_s"] = setup
    log(
        f"offload: engine ready in {setup:.1f}s; GPU allocated {gib(dev.allocated()) or 0:.2f} GiB, "
        f"host RSS peak {gib(host_peak_rss()):.1f} GiB"
    )

    def one_step(b, seed):
        x, y = training.make_batches(1, b, args.seq, cfg.vocab_size, seed=seed, device=dev.device)[0]
        dev.sync()
        t0 = time.perf_counter()
        loss = engine(x, y)
        engine.backward(loss)
        dev.sync()
        t1 = time.perf_counter()
        engine.step()
        value = loss.item()
        dev.sync()
        t2 = time.perf_counter()
        return {"loss": value, "fwd_bwd_s": t1 - t0, "step_s": t2 - t1, "total_s": t2 - t0}

    mb = args.offload_micro_batch
    if mb == "auto" and dev.cuda:
        probe = {}
        for b in (4, 2):  # the first step's extra allocations only make the estimate conservative
            dev.reset_peak()
            s = one_step(b, seed=b)
            probe[b] = dev.peak()
            log(
                f"offload: probe micro-batch {b}: peak {gib(probe[b]):.2f} GiB, step {s['total_s']:.1f}s "
                f"(fwd+bwd {s['fwd_bwd_s']:.2f}s, optimizer {s['step_s']:.2f}s)"
            )
        per_sample = (probe[4] - probe[2]) / 2
        base = probe[2] - 2 * per_sample
        mb = (
            choose_micro_batch(base, per_sample, dev.total(), args.offload_mem_fraction, args.offload_max_micro_batch)
            or 4
        )
        result["probe"] = {
            "peak_gib": {str(k): gib(v) for k, v in probe.items()},
            "per_sample_gib": gib(per_sample),
            "base_gib": gib(base),
            "chosen": mb,
        }
        log(
            f"offload: {gib(per_sample):.2f} GiB of activations per sequence, {gib(base):.2f} GiB besides; "
            f"micro-batch {mb} (peak <= {args.offload_mem_fraction:.0%} of GPU memory)"
        )
    else:
        mb = 4 if mb == "auto" else int(mb)
    save()

    for attempt in range(3):
        try:
            dev.reset_peak()
            warm = one_step(mb, seed=100)
            log(f"offload: micro-batch {mb}, warm-up step {warm['total_s']:.1f}s")
            steps = []
            for i in range(args.offload_steps):
                if steps and time.time() + steps[-1]["total_s"] > args.deadline - 10:
                    result["stopped_early"] = f"time limit after {len(steps)} timed steps"
                    break
                steps.append(one_step(mb, seed=101 + i))
                s = steps[-1]
                log(
                    f"offload: step {i + 1}: {s['total_s']:.2f}s (fwd+bwd {s['fwd_bwd_s']:.2f}s, optimizer step on "
                    f"the host incl. copies {s['step_s']:.2f}s), loss {s['loss']:.4f}"
                )
            break
        except Exception as e:  # noqa: BLE001
            if not is_oom(e) or attempt == 2 or mb == 1:
                raise
            result.setdefault("oom_retries", []).append({"micro_batch": mb, "error": describe_error(e)})
        # Out of the except block: its traceback, whose frames hold the step's activations, is gone.
        log(f"offload: micro-batch {mb} ran out of GPU memory; rebuilding the engine, halving the micro-batch")
        engine = None
        dev.free()
        mb = max(1, mb // 2)
        engine, _ = build()
    tokens = mb * args.seq
    med = statistics.median(s["total_s"] for s in steps)
    report = engine.memory_report()
    result.update(
        micro_batch=mb,
        tokens_per_step=tokens,
        warmup=warm,
        steps=steps,
        median_s=med,
        tokens_per_s=tokens / med,
        peak_gib=gib(dev.peak()),
        mfu=info["flops_per_token"] * tokens / med / result["peak_flops"] if result["peak_flops"] else None,
        memory_report_gib={k: gib(v) for k, v in report.items()},
        host_peak_rss_gib=gib(host_peak_rss()),
    )
    if result.get("probe") and result["probe"]["per_sample_gib"] > 0:
        p = result["probe"]
        extra = 12 * psi  # fp32 masters + two fp32 moments move back to the GPU without offload
        base, per_sample = p["base_gib"] * GiB, p["per_sample_gib"] * GiB
        room = args.offload_mem_fraction * dev.total() - base - extra
        result["predicted_without_offload"] = {
            "peak_gib": gib(base + mb * per_sample + extra),
            "max_micro_batch": max(0, int(room // per_sample)),
        }
    log(
        f"offload: micro-batch {mb}: {result['tokens_per_s']:,.0f} tokens/s"
        + (f", MFU {result['mfu']:.1%}" if result["mfu"] else "")
        + (f", GPU peak {result['peak_gib']:.2f} GiB" if result["peak_gib"] is not None else "")
        + f", host (memory_report) {result['memory_report_gib'].get('host', 0):.2f} GiB, host RSS peak "
        f"{result['host_peak_rss_gib']:.1f} GiB"
    )


def job_offload_off(args, dev, result, save):
    """The same model and micro-batch as the offload part, without offload: expected to run out of memory."""
    from zerotron.models.gpt import config_for

    cfg = replace(config_for(args.offload_model, max_seq_len=args.seq), n_layer=int(args.offload_layers))
    mb = int(args.offload_micro_batch)
    result["model"] = info = model_info(args.offload_model, cfg, args.seq)
    result.update(micro_batch=mb, stage=args.offload_stage, layers=cfg.n_layer)
    log(
        f"offload_off: {info['params'] / 1e9:.2f}B params, micro-batch {mb}, stage {args.offload_stage} "
        "WITHOUT offload (2 steps: the second has the optimizer states resident)"
    )
    phase = "build"
    try:
        model = build_model(cfg, dev, meta_init=args.offload_stage == 3)
        phase = "initialize"
        engine, _ = zerotron_engine(model, mb, args.clip, **offload_sections(args, offload=False))
        result["states_gib"] = gib(dev.allocated())
        dev.reset_peak()
        for i in range(2):
            x, y = training.make_batches(1, mb, args.seq, cfg.vocab_size, seed=100 + i, device=dev.device)[0]
            phase = f"step {i + 1} forward"
            loss = engine(x, y)
            phase = f"step {i + 1} backward"
            engine.backward(loss)
            phase = f"step {i + 1} optimizer"
            engine.step()
            loss.item()
            dev.sync()
        result.update(outcome="fits", peak_gib=gib(dev.peak()))
        log(f"offload_off: it FITS without offload: peak {gib(dev.peak()) or 0:.2f} GiB")
    except Exception as e:  # noqa: BLE001
        if not is_oom(e):
            raise
        result.update(outcome="OOM", oom_at=phase, peak_before_oom_gib=gib(dev.peak()), message=describe_error(e))
        log(f"offload_off: out of GPU memory at {phase} (peak before it {gib(dev.peak()) or 0:.2f} GiB): as expected")
