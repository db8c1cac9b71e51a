"""The GPU runbook's parts, each run in a child process of its own by tools/gpu/run.py: the device, the
models, `mfu`, `ckpt`, `offload` and `offload_off` (`correct` and `sanitized` are in checks.py), and the
arithmetic that sizes the offload part (no torch: unit-tested in tests/test_gpu_runbook_smoke.py)."""

from __future__ import annotations

import datetime
import gc
import math
import os
import resource
import statistics
import time
import traceback
from dataclasses import replace

import torch

from tools import reporting, training
from tools.gpu import checks

GiB = 1 << 30
ADAMW = {"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
T0 = float(os.environ.get("ZT_GPU_BENCH_T0", time.time()))


def log(msg: str) -> None:
    print(f"[{datetime.datetime.now():%H:%M:%S} +{time.time() - T0:6.1f}s] {msg}", flush=True)


# ---- arithmetic (no torch: also unit-tested) ------------------------------------------------------
def pinned_bytes(n: int) -> int:
    """What torch's pinned-memory allocator takes for an n-byte tensor: it rounds every block up to a
    power of two (CachingHostAllocator; `pinned_max_round_threshold` can change that in recent torch)."""
    return 1 << max(0, (int(n) - 1).bit_length())


def offload_host_bytes(psi: int) -> int:
    """Host memory of zerotron's optimizer offload (world of one): fp32 masters and a bf16 staging
    buffer, where the gradients arrive and the weights leave from (zerotron/zero/offload.py, each
    pinned), plus AdamW's two fp32 moments; CPU Adam keeps no fp32 gradients."""
    return pinned_bytes(4 * psi) + pinned_bytes(2 * psi) + 8 * psi


def states_bytes_without_offload(psi: int) -> tuple[int, int]:
    """GPU model-state bytes of zerotron bf16 + AdamW without offload (stage 2, world of one):
    (persistent: bf16 params + bf16 gradients + fp32 masters + two fp32 moments = 16 B/param,
    peak in the step: + the fp32 gradients = 20 B/param)."""
    return 16 * psi, 20 * psi


def pick_layers(fixed: int, per_layer: int, n_layer: int, host_budget: int) -> int:
    """The most layers (<= n_layer) whose model's offload host memory fits `host_budget` (0: none)."""
    best = 0
    for layers in range(1, n_layer + 1):
        if offload_host_bytes(fixed + layers * per_layer) <= host_budget:
            best = layers
    return best


def choose_micro_batch(base: float, per_sample: float, capacity: float, fraction: float, cap: int) -> int | None:
    """The largest micro-batch b (1..cap) with base + b * per_sample <= fraction * capacity; None when the
    measurement is unusable."""
    if per_sample is None or per_sample <= 0 or base is None:
        return None
    return max(1, min(cap, int((fraction * capacity - base) // per_sample)))


def gib(n) -> float | None:
    return None if n is None else n / GiB


# ---- the child: one part --------------------------------------------------------------------------
class Device:
    """The one device a child uses, and its memory counters (None on a CPU)."""

    def __init__(self):
        self.torch = torch
        self.cuda = torch.cuda.is_available()
        if self.cuda:
            torch.cuda.set_device(0)
            self.device = torch.device("cuda", 0)
        else:
            self.device = torch.device("cpu")

    def describe(self) -> dict:
        t = self.torch
        d = {"type": self.device.type, **reporting.environment(torch_threads=t.get_num_threads())}
        if self.cuda:
            props = t.cuda.get_device_properties(0)
            d.update(
                name=t.cuda.get_device_name(0),
                total_memory_gib=round(props.total_memory / GiB, 2),
                cuda=t.version.cuda,
                capability=f"{props.major}.{props.minor}",
                multiprocessors=props.multi_processor_count,
            )
        return d

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def reset_peak(self):
        if self.cuda:
            self.torch.cuda.reset_peak_memory_stats()

    def peak(self) -> int | None:
        return self.torch.cuda.max_memory_allocated() if self.cuda else None

    def allocated(self) -> int | None:
        return self.torch.cuda.memory_allocated() if self.cuda else None

    def total(self) -> int | None:
        return self.torch.cuda.get_device_properties(0).total_memory if self.cuda else None

    def free(self):
        gc.collect()
        if self.cuda:
            self.torch.cuda.empty_cache()

    def peak_flops(self) -> float | None:
        return training.peak_flops(self.torch.cuda.get_device_name(0)) if self.cuda else None


def is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower()


def describe_error(e: BaseException) -> str:
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{'OOM' if is_oom(e) else type(e).__name__}: {first[:300]}"


def host_peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def host_total_bytes(args, dev) -> int:
    if args.host_mem_gib is not None:
        return int(args.host_mem_gib * GiB)
    if dev.cuda:
        return 128 * GiB  # the H200 machine's; its MemTotal starts lower and grows as memory is used
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return 0


def build_model(cfg, dev, seed: int = 0, dtype=None, meta_init: bool = False):
    """The reference GPT, built directly in `dtype` (bf16) on the device: no fp32 copy in host memory."""
    from zerotron.models.gpt import GPT

    dtype = dtype or torch.bfloat16
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(dev.device):
            if meta_init:  # parameters go to the meta device as they are made (on the GPU, fast)
                import zerotron.zero

                with zerotron.zero.Init():
                    return GPT(cfg)
            return GPT(cfg)
    finally:
        torch.set_default_dtype(previous)


def param_counts(cfg) -> tuple[int, int, int]:
    """(parameters, parameters per block, parameters outside the blocks) of the reference GPT: the planner's
    count from the layer shapes, not a build, so a 13b costs nothing. tests/test_gpu_runbook_smoke.py checks it
    against the model for every size."""
    shape = training.gpt_shape(cfg)
    block = sum(n for where, n, _ in shape.tensors() if where == "block") // cfg.n_layer
    return shape.parameters, block, shape.parameters - cfg.n_layer * block


flops_per_token = (
    training.flops_per_token
)  # GPT.flops_per_token from the config: 6N + 12*L*d*s, N without the embedding


def zerotron_engine(model, micro_batch: int, clip: float, **sections):
    """zerotron in bf16 with this script's AdamW."""
    return training.zerotron_step(model, micro_batch, clip, adamw=ADAMW, **{"bf16": {"enabled": True}, **sections})


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


def model_info(name: str, cfg, seq: int) -> dict:
    """Size, parameters and FLOPs per token, from the planner's count of the config."""
    shape = training.gpt_shape(cfg)
    return {
        "size": name,
        "n_layer": cfg.n_layer,
        "d_model": cfg.d_model,
        "n_head": cfg.n_head,
        "ffn": cfg.ffn,
        "params": shape.parameters,
        "flops_per_token": shape.flops_per_token(seq),
        "seq": seq,
    }


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


JOBS = {
    "correct": checks.job_correct,
    "mfu": job_mfu,
    "ckpt": job_ckpt,
    "offload": job_offload,
    "offload_off": job_offload_off,
    "sanitized": checks.job_sanitized,
}


def child_main(args) -> int:
    if args.deadline is None:
        args.deadline = math.inf
    result = {"job": args.job}

    def save():
        if args.result_file is not None:
            reporting.write_json(args.job, result, args.result_file)

    try:
        dev = Device()
        result["device"] = dev.describe()
        save()
        JOBS[args.job](args, dev, result, save)
    except Exception as e:  # noqa: BLE001 - recorded, and the parent goes on with the next part
        traceback.print_exc()
        result["error"] = describe_error(e)
    save()
    return 0
