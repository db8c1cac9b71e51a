"""What every part of the GPU runbook uses in its child process (tools/gpu/parts.py): the log, the device and its
memory counters, errors (out of memory), the host's memory, and the model (built in bf16 on the device, its
parameter count, size and FLOPs) and zerotron's bf16 engine with the runbook's AdamW."""

from __future__ import annotations

import datetime
import gc
import os
import resource
import time
import warnings

import torch

from tools import reporting, training
from tools.gpu.sizing import GiB

ADAMW = {"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
T0 = float(os.environ.get("ZT_GPU_BENCH_T0", time.time()))


def host_syncs(engine, train, warmup, batches, budget: int) -> dict:
    """The host syncs of `train(engine, batches)` after `train(engine, warmup)`, from torch.cuda.set_sync_debug_mode
    ("warn"), against `budget` (on a CPU there is nothing to wait for: tests/test_fake_cuda.py counts them there,
    on a fake GPU)."""
    train(engine, warmup)
    if not torch.cuda.is_available():
        return {"skipped": "no GPU to wait for (tests/test_fake_cuda.py counts them on a fake one)"}
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            train(engine, batches)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    where = [str(w.message).splitlines()[0][:160] for w in seen if "synchroniz" in str(w.message)]
    return {"count": len(where), "budget": budget, "where": where[:20], "ok": len(where) <= budget}


def log(msg: str) -> None:
    print(f"[{datetime.datetime.now():%H:%M:%S} +{time.time() - T0:6.1f}s] {msg}", flush=True)


# ---- the device, errors, host memory and the model (every part) ------------------------------------
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
