"""The one-GPU runbook (H100 / H200): correctness checks, zerotron's MFU next to plain PyTorch, CPU offload,
activation checkpointing. From the repository root:

    python -m tools.gpu                          # on the GPU machine: all parts, about 4-6 minutes
    python -m tools.gpu --out $OUT/gpu.json      # ... and keep the JSON somewhere that comes back
    python -m tools.gpu --smoke                  # tiny model on the CPU (gloo, world of one): every code path, < 1 min
    python -m tools.gpu --parts mfu --micro-batch 16

Each part runs in a child process of its own under a time limit (the parent only asks NVML whether there is a
GPU), so a part that fails, runs out of memory, hangs or is killed is recorded as such and the others still run;
results print as they come, then a summary, and the JSON is rewritten after each part:

0. `correct`: tools/gpu/checks.py (ZeRO/offload parity, overflow, checkpoint round trip, host syncs).
1. `mfu`: the reference GPT (`--mfu-model 1.3b`, seq 2048, micro-batch 8) in bf16 with fp32 masters and fused
   AdamW, by `zerotron.initialize` (ZeRO 0) and by a plain PyTorch loop doing the same math (`--systems ...,
   plain_autocast` adds torch's usual AMP); same seed and batches; tokens/s from the median step between
   synchronizations; MFU = the model's FLOPs per token (the planner's 6N + 12·L·d·s) x tokens/s / the GPU's
   peak in the planner's hardware table; peak memory = `torch.cuda.max_memory_allocated()`.
2. `offload` (+ `offload_off`): ZeRO-Offload (stage 2, `offload_optimizer` pinned): the memory arithmetic of
   `--offload-model` (13b) against GPU and host memory, then as many of its layers as the host holds at the
   largest micro-batch that fits (two probe steps); `offload_off` repeats that without offload (OOM expected).
3. `ckpt`: `checkpoint_policy` none | every_block | selective on `--ckpt-model 350m`: step time, tokens/s, MFU
   (recomputation not counted), peak memory and its activation part.

Models are built directly in bf16 on the device: no fp32 copy in host memory. This file is the command line and the
parent; in the children parts.py runs each part: throughput.py `mfu` and `ckpt`, offload.py `offload`, checks.py
`correct` and `sanitized` (device.py and sizing.py what they share); summary.py writes the closing summary. Details:
tools/README.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # zerotron and tools/ from this checkout, installed or not
from tools import processes, reporting  # noqa: E402
from tools.gpu.device import T0, log  # noqa: E402
from tools.gpu.parts import child_main  # noqa: E402
from tools.gpu.summary import summarize  # noqa: E402

# Seconds each part may take on the GPU, in the order they run: together 420 s, so with one part killed at its
# grace the whole run ends inside the 480 s budget (8 minutes on one H200) and every part gets its turn; each is
# capped by what is left of --time-budget all the same. The parts stop measuring near their own deadline.
JOB_LIMITS = {"correct": 100, "mfu": 75, "ckpt": 55, "offload": 110, "offload_off": 40, "sanitized": 40}
JOB_LIMITS_SMOKE = {"correct": 150, "mfu": 90, "ckpt": 90, "offload": 90, "offload_off": 90, "sanitized": 90}
MIN_JOB_S = 20  # a part gets at least this much time, or is skipped
GRACE_S = 20  # beyond a child's own deadline before it is killed


# ---- arguments ---------------------------------------------------------------------------------------
SMOKE = {
    "seq": 64,
    "mfu_model": "tiny",
    "micro_batch": 2,
    "warmup": 1,
    "steps": 2,
    "systems": "zerotron,plain,plain_autocast",
    "ckpt_model": "tiny",
    "ckpt_micro_batch": 2,
    "offload_model": "tiny",
    "offload_micro_batch": "2",
    "offload_steps": 2,
    "time_budget": 360,
}
GPU = {
    "seq": 2048,
    "mfu_model": "1.3b",
    "micro_batch": 8,
    "warmup": 3,
    "steps": 10,
    "systems": "zerotron,plain",
    "ckpt_model": "350m",
    "ckpt_micro_batch": 8,
    "offload_model": "13b",
    "offload_micro_batch": "auto",
    "offload_steps": 2,
    "time_budget": 480,
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="tiny model on the CPU (gloo, world of one), a few steps")
    p.add_argument(
        "--parts",
        default="correct,mfu,ckpt,offload,sanitized",
        help="comma-separated, run in this order of importance: correct (tools/gpu/checks.py), mfu, ckpt, "
        "offload, sanitized (the ZeRO/offload parity again under TORCH_CUDA_SANITIZER=1: stream races)",
    )
    p.add_argument("--time-budget", type=float, default=None, help="seconds for the whole run (default 480; smoke 360)")
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="result JSON (default bench/results/gpu.json; smoke: bench/results/gpu_smoke.json)",
    )
    p.add_argument("--seq", type=int, default=None, help="sequence length (default 2048)")
    p.add_argument("--clip", type=float, default=1.0, help="gradient clipping for every system (0: off)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per system (default 3)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per system (default 10)")
    g = p.add_argument_group("part 1: MFU")
    g.add_argument("--mfu-model", default=None, help="reference GPT size (default 1.3b)")
    g.add_argument("--micro-batch", type=int, default=None, help="sequences per step (default 8)")
    g.add_argument("--systems", default=None, help="zerotron,plain[,plain_autocast] (default zerotron,plain)")
    g = p.add_argument_group("part 2: offload")
    g.add_argument("--offload-model", default=None, help="reference GPT size to assess and train (default 13b)")
    g.add_argument(
        "--offload-layers",
        default="auto",
        help="layers of that shape to train; auto: all, or as many as host memory holds",
    )
    g.add_argument(
        "--offload-stage",
        type=int,
        choices=[2, 3],
        default=2,
        help="ZeRO stage (3 adds offload_param and builds the model under zerotron.zero.Init)",
    )
    g.add_argument(
        "--offload-micro-batch",
        default=None,
        help="sequences per step, or auto: the largest that fits --offload-mem-fraction (default auto)",
    )
    g.add_argument("--offload-max-micro-batch", type=int, default=32)
    g.add_argument(
        "--offload-mem-fraction",
        type=float,
        default=0.85,
        help="auto micro-batch: predicted peak at most this fraction of GPU memory",
    )
    g.add_argument("--offload-steps", type=int, default=None, help="timed offload steps (default 2)")
    g.add_argument(
        "--host-mem-gib",
        type=float,
        default=None,
        help="host memory to plan with (default 128 on a GPU, the H200 machine's; MemTotal on a CPU). "
        "Not MemTotal on the GPU machine: its memory grows as it is used",
    )
    g.add_argument("--host-reserve-gib", type=float, default=16.0, help="host memory left for everything else")
    g.add_argument("--no-oom-demo", action="store_true", help="skip the run without offload")
    g.add_argument(
        "--cpu-threads",
        type=int,
        default=0,
        help="threads for the host-side AdamW on a GPU machine (default 0: every core)",
    )
    g = p.add_argument_group("part 3: activation checkpointing")
    g.add_argument("--ckpt-model", default=None, help="reference GPT size (default 350m)")
    g.add_argument("--ckpt-micro-batch", type=int, default=None, help="sequences per step (default 8)")
    g.add_argument("--ckpt-policies", default="none,every_block,selective")
    # Internal: how the parent runs one part in a child process.
    p.add_argument("--job", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result-file", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    for key, value in (SMOKE if args.smoke else GPU).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.parts = [s for s in args.parts.split(",") if s]
    args.systems = [s for s in args.systems.split(",") if s]
    args.ckpt_policies = [s for s in args.ckpt_policies.split(",") if s]
    for name, allowed in (
        ("parts", ("correct", "mfu", "ckpt", "offload", "sanitized")),
        ("systems", ("zerotron", "plain", "plain_autocast")),
        ("ckpt_policies", ("none", "every_block", "every_k", "selective")),
    ):
        bad = [v for v in getattr(args, name) if v not in allowed]
        if bad:
            p.error(f"--{name.replace('_', '-')}: unknown {bad}; choose from {', '.join(allowed)}")
    return args


# ---- the parent: runs each part in a child process ------------------------------------------------
def parent_main(args) -> int:
    os.environ["ZT_GPU_BENCH_T0"] = str(T0)
    deadline = T0 + args.time_budget
    out = args.out or reporting.RESULTS / ("gpu_smoke.json" if args.smoke else "gpu.json")
    if not args.smoke:
        os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"  # ask NVML: the parent never initializes CUDA
        available = torch.cuda.is_available()
        del os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"]
        if not available:
            print("tools/gpu needs a CUDA GPU; on a CPU use --smoke", file=sys.stderr)
            return 2
    payload = {
        "benchmark": "gpu",
        "mode": "smoke (CPU)" if args.smoke else "gpu",
        "started": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "args": {
            k: (str(v) if isinstance(v, Path) else v)
            for k, v in vars(args).items()
            if k not in ("job", "result_file", "deadline", "argv")
        },
        "jobs": {},
    }
    jobs = [j for j in ("correct", "mfu", "ckpt") if j in args.parts]
    if "offload" in args.parts:
        jobs += ["offload"] + ([] if args.no_oom_demo else ["offload_off"])
    if "sanitized" in args.parts:
        jobs.append("sanitized")
    limits = JOB_LIMITS_SMOKE if args.smoke else JOB_LIMITS
    log(
        f"tools/gpu ({payload['mode']}): parts {', '.join(jobs)}; time budget {args.time_budget:.0f}s; results -> {out}"
    )
    for job in jobs:
        extra = []
        if job == "offload_off":
            done = payload["jobs"].get("offload", {})
            if not done.get("layers") or not done.get("micro_batch"):
                payload["jobs"][job] = {"skipped": "the offload part gave no model/micro-batch to repeat"}
                log(f"{job}: skipped ({payload['jobs'][job]['skipped']})")
                continue
            extra = ["--offload-layers", str(done["layers"]), "--offload-micro-batch", str(done["micro_batch"])]
        left = deadline - time.time() - GRACE_S
        if left < MIN_JOB_S:
            payload["jobs"][job] = {"skipped": f"time budget: {left:.0f}s left"}
            log(f"{job}: skipped ({payload['jobs'][job]['skipped']})")
            continue
        payload["jobs"][job] = run_child(job, min(limits[job], left), extra, args.smoke, args.argv)
        reporting.write_json("gpu", payload, out)
    payload["finished"] = datetime.datetime.now().isoformat(timespec="seconds")
    payload["wall_s"] = round(time.time() - T0, 1)
    payload["summary"] = summarize(payload)
    reporting.write_json("gpu", payload, out)
    print("\n".join(payload["summary"]), flush=True)
    log(f"done in {payload['wall_s']:.0f}s; wrote {out}")
    failed = failed_parts(payload)
    if failed:
        log(f"FAILED: {', '.join(failed)}")
    return 1 if failed else 0


def failed_parts(payload: dict) -> list[str]:
    """The parts that raised, were killed, or whose checks did not all pass: any of them fails the run."""
    return [j for j, r in payload["jobs"].items() if r.get("error") or r.get("all_ok") is False]


def run_child(job: str, limit: float, extra: list[str], smoke: bool, argv: list[str]) -> dict:
    """Run one part in a fresh process (a world of one: no launcher variables), at most `limit` seconds."""
    env = processes.child_env(
        **({"CUDA_VISIBLE_DEVICES": ""} if smoke else {}),  # smoke: the CPU path, even on a GPU
        **({"CUBLAS_WORKSPACE_CONFIG": ":4096:8"} if job == "correct" else {}),  # deterministic
        # torch's CUDA sanitizer: a kernel reading memory another stream writes unsynchronized
        # raises (offload's side streams, ZeRO-3's gathers); set before torch is imported
        **({"TORCH_CUDA_SANITIZER": "1"} if job == "sanitized" and not smoke else {}),
    )
    start = time.time()
    with tempfile.TemporaryDirectory(prefix="zt_gpu_bench_") as tmp:
        result_file = Path(tmp) / "result.json"
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            *argv,
            "--job",
            job,
            "--result-file",
            str(result_file),
            "--deadline",
            str(start + limit),
            *extra,
        ]
        log(f"{job}: starting (limit {limit:.0f}s)")
        rc, _, _ = processes.run_limited(cmd, limit + GRACE_S, env, capture=False)
        try:
            result = json.loads(result_file.read_text())
        except (OSError, ValueError):
            result = {}
    result["wall_s"] = round(time.time() - start, 1)
    if rc != 0 and not result.get("error"):
        if rc is None:
            result["error"] = f"killed after {limit + GRACE_S:.0f}s (time limit)"
        elif rc < 0:
            result["error"] = f"killed by signal {-rc}" + (" (host out of memory?)" if -rc == signal.SIGKILL else "")
        else:
            result["error"] = f"exit status {rc}"
    log(f"{job}: {'FAILED: ' + result['error'] if result.get('error') else 'done'} ({result['wall_s']:.0f}s)")
    return result


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.job:
        rc = child_main(args)
        # The result is written: skip torch's teardown (process group, CUDA context), seconds per part.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    return parent_main(args)


if __name__ == "__main__":
    sys.exit(main())
