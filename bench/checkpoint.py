"""Checkpoints: save / load time, size on disk, cross-topology load, and `zerotron convert`'s memory.

One run of `python bench/checkpoint.py` does, in a scratch directory:

1. a 2-rank torchrun job: for ZeRO-1 and ZeRO-3 (fp32, AdamW from the config) a seeded GPT takes one
   step and `engine.save_checkpoint` runs `--repeats` times (each into a fresh tag, then `os.sync()`,
   timed separately); rank 0 then `torch.save`s a plain full state dict of the same model (model +
   torch AdamW state: the same tensors, one file) as the reference. Then fresh engines (other seed)
   of each stage `engine.load_checkpoint` each checkpoint (same topology, and the other stage on the
   same 2 ranks), check the weights against the saved model and the next two losses against the
   uninterrupted run. It also times SHA-256 of the rank files (load verifies every file it opens).
2. a 1-rank torchrun job: the ZeRO-3 checkpoint loaded by ZeRO-1 on one rank (and ZeRO-1 -> ZeRO-3).
3. `python -m zerotron.cli convert` as a subprocess: wall time and its own peak RSS (ru_maxrss, read by
   a torch-free launcher: see LAUNCHER), next to the largest tensor, the model size and the peak RSS of
   a python that only imports torch + zerotron + safetensors; then two instrumented converts in one
   process each (probes of RssAnon / RssFile / mapped rank files around every parameter; the second
   with safetensors' pread backend instead of mmap) that say where the memory goes.

Loads read files the save just wrote, so they come from the page cache (warm), as do the converts.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench import common  # noqa: E402
from tools import processes, reporting, training  # noqa: E402
from zerotron.checkpoint.files import rank_file, sha256  # noqa: E402
from zerotron.models.gpt import GPT, config_for  # noqa: E402
from zerotron.zero import consolidated_state_dict  # noqa: E402

STAGES = (1, 3)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="large", help="zerotron.models.gpt size name (default large, ~23.5M params)")
    p.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="timed saves and same-topology loads per case (other-stage loads: 1; converts: up to 2)",
    )
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=4, help="sequences per step, globally")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--workdir", type=Path, default=None, help="scratch directory (default: a new one under /tmp)")
    p.add_argument("--keep", action="store_true", help="keep the scratch directory")
    p.add_argument("--out", type=Path, default=None, help="result JSON (default bench/results/checkpoint.json)")
    p.add_argument("--phase", default="driver", choices=["driver", "main", "reload", "probe"], help=argparse.SUPPRESS)
    return p.parse_args()


# ---- helpers used in every phase ----------------------------------------------------------------------
def mib(n: float) -> float:
    return n / 2**20


def dir_bytes(path: Path) -> dict:
    files = [f for f in Path(path).rglob("*") if f.is_file()]
    return {
        "files": len(files),
        "bytes": sum(f.stat().st_size for f in files),
        "allocated_bytes": sum(f.stat().st_blocks * 512 for f in files),
    }


def proc_status() -> dict:
    """This process's VmRSS, VmHWM, RssAnon, RssFile in bytes."""
    text = Path("/proc/self/status").read_text()
    return {k: int(v) * 1024 for k, v in re.findall(r"^(VmRSS|VmHWM|RssAnon|RssFile):\s+(\d+) kB", text, re.M)}


def reset_peak():
    """Reset this process's VmHWM to its current RSS (Linux: write 5 to /proc/self/clear_refs)."""
    Path("/proc/self/clear_refs").write_text("5")


def mapped_rss(pattern: str) -> int:
    """Bytes resident in this process's mappings of files whose path matches `pattern` (from smaps)."""
    total, match = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
            parts = line.split(None, 5)
            match = len(parts) > 5 and re.search(pattern, parts[5]) is not None
        elif match and line.startswith("Rss:"):
            total += int(line.split()[1]) * 1024
    return total


def model_facts(size: str) -> dict:
    torch.manual_seed(0)
    model = GPT(config_for(size))
    params = dict(model.named_parameters())
    largest = max(params.items(), key=lambda kv: kv[1].numel())
    n = sum(p.numel() for p in params.values())
    return {
        "size": size,
        "params": n,
        "fp32_bytes": 4 * n,
        "tensors": len(params),
        "largest_tensor": largest[0],
        "largest_shape": list(largest[1].shape),
        "largest_fp32_bytes": 4 * largest[1].numel(),
    }


# ---- phase: the 2-rank job ----------------------------------------------------------------------------
def engine_for(size, stage, per_rank, seed):
    torch.manual_seed(seed)
    return training.zerotron_step(GPT(config_for(size)), per_rank, 0.0, stage=stage)[0]


def train_steps(engine, batches) -> list[float]:
    """Losses of `batches` (mean over ranks, i.e. the global-batch loss)."""
    out = []
    for tokens, targets in batches:
        loss = engine(tokens, targets)
        engine.backward(loss)
        engine.step()
        t = loss.detach().double().reshape(1)
        dist.all_reduce(t)
        out.append(t.item() / dist.get_world_size())
    return out


_LOAD_PROBE = {"on": False}


def probe_loads():
    """Sample RssAnon / RssFile whenever load_checkpoint has read a parameter's pieces (in assemble) and
    assembled it (after SavedPieces.full): where a load's memory goes, anonymous or mapped file pages."""
    import zerotron.checkpoint.load as load

    real_full, real_assemble = load.SavedPieces.full, load.assemble

    def note():
        if _LOAD_PROBE["on"]:
            s, b = proc_status(), _LOAD_PROBE["base"]
            _LOAD_PROBE["anon"] = max(_LOAD_PROBE["anon"], s["RssAnon"] - b["RssAnon"])
            _LOAD_PROBE["file"] = max(_LOAD_PROBE["file"], s["RssFile"] - b["RssFile"])

    def full(self, name, kind):
        t = real_full(self, name, kind)
        note()
        return t

    def assemble(parts, name):
        note()
        return real_assemble(parts, name)

    load.SavedPieces.full, load.assemble = full, assemble


def timed(fn, sync: bool = False, peak: list | None = None):
    """(seconds of fn between barriers, seconds of os.sync() after it or None). With `peak` (a list),
    appends this rank's RSS growth during fn: {"peak": VmHWM after - VmRSS before (the high-water
    mark reset first), "anon" / "file": the largest RssAnon / RssFile growth probe_loads saw}."""
    dist.barrier()
    if peak is not None:
        reset_peak()
        before = proc_status()
        _LOAD_PROBE.update(on=True, base=before, anon=0, file=0)
    t0 = time.perf_counter()
    fn()
    if peak is not None:
        _LOAD_PROBE["on"] = False
        peak.append(
            {"peak": proc_status()["VmHWM"] - before["VmRSS"], "anon": _LOAD_PROBE["anon"], "file": _LOAD_PROBE["file"]}
        )
    dist.barrier()
    seconds = time.perf_counter() - t0
    sync_s = None
    if sync:  # flush the dirty pages now, so that one measurement's writeback does not slow the next
        t0 = time.perf_counter()
        if dist.get_rank() == 0:
            os.sync()
        dist.barrier()
        sync_s = time.perf_counter() - t0
    return seconds, sync_s


def gather_ranks(value: int) -> list[int]:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def max_diff(state: dict, ref: dict) -> float:
    return max((state[k].float() - ref[k].float()).abs().max().item() for k in ref)


def load_case(args, key, stage, src, per_rank, repeats, ref_weights, ref_losses, batches, log) -> dict:
    """A fresh engine of `stage` (other weights until loaded) loads the zero{src} checkpoint `repeats` times:
    seconds, RSS growth per rank, weights against the saved ones, next two losses against the run that went on."""
    engine = engine_for(args.model, stage, per_rank, seed=1)
    ckpt = str(args.workdir / f"zero{src}")
    peaks = []
    loads = [timed(lambda: engine.load_checkpoint(ckpt), peak=peaks)[0] for _ in range(repeats)]
    peaks = gather_ranks(peaks)
    diff = max_diff(consolidated_state_dict(engine.module), ref_weights())  # (loaded after the timed loads)
    losses = train_steps(engine, batches[1:3])
    log(
        f"{key}: load {', '.join(f'{s:.2f}' for s in loads)} s; max |dw| {diff:.1e}; next losses "
        f"{losses} vs {ref_losses}"
    )
    return {
        "seconds": loads,
        "median_s": statistics.median(loads),
        "max_abs_weight_diff": diff,
        "rss_growth_per_rank": peaks,
        "losses": losses,
        "ref_losses": ref_losses,
        "max_rel_loss_diff": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
    }


def phase_main(args):
    rank, world = common.init_gloo()
    log = print if rank == 0 else (lambda *a, **k: None)
    probe_loads()
    work = args.workdir
    per_rank = args.batch // world
    cfg = config_for(args.model)
    batches = training.make_batches(3, args.batch, args.seq, cfg.vocab_size, rank, world)
    res = {"environment": reporting.environment(), "save": {}, "load": {}, "torch": {}, "sha256": {}, "ref_losses": {}}

    for stage in STAGES:
        engine = engine_for(args.model, stage, per_rank, seed=0)
        train_steps(engine, batches[:1])
        ckpt = work / f"zero{stage}"
        saves, syncs, peaks = [], [], []
        for i in range(args.repeats):
            s, y = timed(lambda: engine.save_checkpoint(str(ckpt), tag=f"r{i}"), sync=True, peak=peaks)
            saves.append(s)
            syncs.append(y)
            if rank == 0 and i:
                shutil.rmtree(ckpt / f"r{i - 1}")
            dist.barrier()
        tag_dir = ckpt / f"r{args.repeats - 1}"
        full = consolidated_state_dict(engine.module)  # every rank: the reference weights
        res["save"][f"zero{stage}"] = {
            "seconds": saves,
            "median_s": statistics.median(saves),
            "sync_s": syncs,
            "rss_growth_per_rank": gather_ranks(peaks),
            "disk": dir_bytes(tag_dir) if rank == 0 else None,
            "rank_files": {f.name: f.stat().st_size for f in sorted(tag_dir.iterdir())},
        }
        log(
            f"zero{stage}: save {', '.join(f'{s:.2f}' for s in saves)} s (+ sync {', '.join(f'{y:.2f}' for y in syncs)}"
            f" s), {mib(res['save'][f'zero{stage}']['disk']['bytes']) if rank == 0 else 0:.1f} MiB on disk"
        )

        # SHA-256 of the files a load verifies (each rank opens, hence hashes, every file it needs)
        if rank == 0:
            t0 = time.perf_counter()
            for r in range(world):
                sha256(tag_dir / rank_file(r))
            res["sha256"][f"zero{stage}"] = {
                "all_files_s": time.perf_counter() - t0,
                "bytes": sum((tag_dir / rank_file(r)).stat().st_size for r in range(world)),
            }

        # the reference: torch.save of a plain full state dict (model + torch AdamW state) from rank 0
        if rank == 0:
            plain = GPT(cfg)
            plain.load_state_dict(full)
            opt = torch.optim.AdamW(plain.parameters(), **training.ADAMW)
            for p in plain.parameters():
                p.grad = torch.zeros_like(p)
            opt.step()  # creates the state: step, exp_avg, exp_avg_sq per parameter
            plain.load_state_dict(full)  # (the zero-gradient step decayed the weights; put them back)
            reference = {"model": plain.state_dict(), "optimizer": opt.state_dict()}
        t_save, t_sync, t_load, t_peaks = [], [], [], []
        for i in range(args.repeats):
            path = work / f"torch_zero{stage}.pt"
            s, y = timed(lambda: torch.save(reference, path) if rank == 0 else None, sync=True, peak=t_peaks)
            t_save.append(s)
            t_sync.append(y)
        for i in range(args.repeats):
            t_load.append(timed(lambda: torch.load(path, weights_only=True) if rank == 0 else None)[0])
        res["torch"][f"zero{stage}"] = {
            "save_seconds": t_save,
            "save_median_s": statistics.median(t_save),
            "sync_s": t_sync,
            "load_seconds": t_load,
            "save_rss_growth_rank0": t_peaks if rank == 0 else None,
            "load_median_s": statistics.median(t_load),
            "bytes": path.stat().st_size if rank == 0 else None,
        }
        if rank == 0:
            del reference, plain, opt
        log(
            f"zero{stage}: torch.save {', '.join(f'{s:.2f}' for s in t_save)} s, torch.load "
            f"{', '.join(f'{s:.2f}' for s in t_load)} s"
        )
        res["ref_losses"][f"zero{stage}"] = train_steps(engine, batches[1:3])  # uninterrupted continuation
        if rank == 0:
            torch.save(full, work / f"full_zero{stage}.0.pt")
        engine = full = None
        dist.barrier()

    refs = {s: torch.load(work / f"full_zero{s}.0.pt", weights_only=True) for s in STAGES}
    for stage in STAGES:
        for src in STAGES:  # the other stage's checkpoint: once (runtime)
            key = f"zero{src}_2ranks->zero{stage}_2ranks"
            res["load"][key] = load_case(
                args,
                key,
                stage,
                src,
                per_rank,
                args.repeats if src == stage else 1,
                lambda: refs[src],
                res["ref_losses"][f"zero{src}"],
                batches,
                log,
            )
    if rank == 0:
        (work / "main.json").write_text(json.dumps(res, indent=1))
    dist.barrier()
    dist.destroy_process_group()


# ---- phase: the 1-rank job ----------------------------------------------------------------------------
def phase_reload(args):
    rank, world = common.init_gloo()
    probe_loads()
    work = args.workdir
    main = json.loads((work / "main.json").read_text())
    batches = training.make_batches(3, args.batch, args.seq, config_for(args.model).vocab_size, rank, world)
    res = {}
    for src, stage in ((3, 1), (1, 3)):
        key = f"zero{src}_2ranks->zero{stage}_1rank"
        res[key] = load_case(
            args,
            key,
            stage,
            src,
            args.batch,
            args.repeats if stage == 1 else 1,
            lambda: torch.load(work / f"full_zero{src}.0.pt", weights_only=True),
            main["ref_losses"][f"zero{src}"],
            batches,
            print,
        )
    (work / "reload.json").write_text(json.dumps(res, indent=1))
    dist.destroy_process_group()


# ---- phase: an instrumented convert (one process, no torchrun) ------------------------------------------
def phase_probe(args):
    """Run convert() in this process with probes of RssAnon / RssFile: before reading the pieces of each
    parameter, after reading them (inside assemble), after assembling, and while the bytes go to the file
    (for the largest tensor and after the last write also the resident bytes of the mapped rank files,
    from smaps, which costs ~50 ms a read: convert_in_process_s includes that). The peak is reset after the
    imports, so VmHWM at the end is the exact peak of convert() itself. With --probe-pread, the
    checkpoint's files are opened with safetensors' pread backend instead of mmap (what-if, no edit)."""
    import gc

    import zerotron.checkpoint.export as export
    import zerotron.checkpoint.load as load

    src, out, largest = args.probe_src, args.probe_out, args.probe_largest
    samples = []
    current = {"name": None}
    RANK_FILES = r"rank\d+\.safetensors"

    def sample(where, maps=False):
        samples.append(
            {
                "param": current["name"],
                "where": where,
                **proc_status(),
                **({"rank_files_mapped_rss": mapped_rss(RANK_FILES)} if maps else {}),
            }
        )

    real_full, real_assemble = load.SavedPieces.full, load.assemble

    def full(self, name, kind):
        current["name"] = name
        sample("before reading pieces")
        t = real_full(self, name, kind)
        sample("assembled (pieces freed)")
        return t

    def assemble(parts, name):
        sample("pieces read (get_tensor)")
        return real_assemble(parts, name)

    class ProbedFile:
        def __init__(self, f):
            self.f = f

        def write(self, data):
            sample(f"file.write of {len(data)} bytes", maps=current["name"] == largest)
            return self.f.write(data)

        def flush(self):  # close() flushes after the last tensor: the rank files' mapped pages then
            current["name"] = None
            sample("after the last write", maps=True)
            return self.f.flush()

        def __getattr__(self, name):
            return getattr(self.f, name)

    real_init = export.StreamingSafetensors.__init__

    def init(self, *a, **k):
        real_init(self, *a, **k)
        self.file = ProbedFile(self.file)

    load.SavedPieces.full, load.assemble, export.StreamingSafetensors.__init__ = full, assemble, init
    if args.probe_pread:
        real_open = load.safe_open
        load.safe_open = lambda *a, **k: real_open(*a, **{**k, "backend": "pread"})
    gc.collect()
    reset_peak()
    sample("imports done", maps=True)
    t0 = time.perf_counter()
    export.convert(src, out, "fp32")
    seconds = time.perf_counter() - t0
    current["name"] = None
    sample("convert returned", maps=True)
    base = samples[0]
    peak = max(samples, key=lambda s: s["RssAnon"])
    report = {
        "backend": "pread" if args.probe_pread else "mmap (safetensors default)",
        "convert_in_process_s": seconds,
        "after_imports": base,
        "end": samples[-1],
        "peak_anon_sample": peak,
        "largest_param_samples": [s for s in samples if s["param"] == largest],
        "anon_delta_max_bytes": peak["RssAnon"] - base["RssAnon"],
        "file_delta_max_bytes": max(s["RssFile"] for s in samples) - base["RssFile"],
        "rank_files_mapped_rss_max_bytes": max(s.get("rank_files_mapped_rss", 0) for s in samples),
        "peak_growth_bytes": samples[-1]["VmHWM"] - base["VmRSS"],
    }
    print(json.dumps(report))


# ---- the driver ---------------------------------------------------------------------------------------
# A child's ru_maxrss is at least the RSS of the process that forked it (Linux records the old mm's
# high-water mark at exec, and a vfork/fork child's old mm is its parent's, ~300 MiB here with torch
# and a model loaded). So every measured command is started by this small torch-free launcher, which
# starts it, waits for it with wait4 and prints its ru_maxrss (KiB) and wall seconds as the last line.
LAUNCHER = """import os, sys, time
t0 = time.perf_counter()
pid = os.posix_spawn(sys.argv[1], sys.argv[1:], os.environ)
_, status, usage = os.wait4(pid, 0)
sys.stdout.flush()
print("LAUNCHER", os.waitstatus_to_exitcode(status), usage.ru_maxrss, time.perf_counter() - t0, flush=True)
"""


def run_child(cmd, env=None, launcher: bool = True) -> dict:
    """Run cmd; its wall seconds, exit code and its own peak RSS (ru_maxrss of exactly that process)."""
    t0 = time.perf_counter()
    full = [sys.executable, "-c", LAUNCHER, *cmd] if launcher else cmd
    p = subprocess.Popen(full, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out = p.stdout.read().decode(errors="replace")
    _, status, usage = os.wait4(p.pid, 0)
    p.stdout.close()
    res = {
        "seconds": time.perf_counter() - t0,
        "rc": os.waitstatus_to_exitcode(status),
        "maxrss_bytes": usage.ru_maxrss * 1024,
        "output": out,
    }
    if launcher:
        last = [line for line in out.splitlines() if line.startswith("LAUNCHER ")][-1].split()
        res.update(
            rc=int(last[1]),
            maxrss_bytes=int(last[2]) * 1024,
            seconds=float(last[3]),
            launcher_maxrss_bytes=usage.ru_maxrss * 1024,
        )
        res["output"] = out[: out.rfind("LAUNCHER ")]
    return res


def torchrun(args, phase, nproc, env):
    cmd = processes.torchrun_cmd(
        nproc,
        HERE,
        "--phase",
        phase,
        "--workdir",
        args.workdir,
        "--model",
        args.model,
        "--repeats",
        args.repeats,
        "--seq",
        args.seq,
        "--batch",
        args.batch,
    )
    t0 = time.perf_counter()
    rc = subprocess.call(cmd, env=env)
    if rc:
        raise SystemExit(f"{phase} job failed (exit {rc})")
    return time.perf_counter() - t0


def driver(args):
    t_start = time.perf_counter()
    load_start = os.getloadavg()[0]
    created = args.workdir is None
    args.workdir = args.workdir or Path(tempfile.mkdtemp(prefix="zt_ckpt_bench_"))
    args.workdir.mkdir(parents=True, exist_ok=True)
    env = processes.child_env(OMP_NUM_THREADS=1, DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "cpu"))
    facts = model_facts(args.model)
    print(
        f"GPT {args.model}: {facts['params'] / 1e6:.2f}M params ({mib(facts['fp32_bytes']):.1f} MiB fp32), largest "
        f"tensor {facts['largest_tensor']} {facts['largest_shape']} ({mib(facts['largest_fp32_bytes']):.2f} MiB); "
        f"scratch {args.workdir}; load average {load_start:.2f}"
    )
    try:
        main_s = torchrun(args, "main", args.nproc, env)
        reload_s = torchrun(args, "reload", 1, env)
        main = json.loads((args.workdir / "main.json").read_text())
        reload = json.loads((args.workdir / "reload.json").read_text())

        # convert: the baseline process, then the converts, each its own child with its own ru_maxrss
        imports = "import torch, safetensors.torch, zerotron, zerotron.cli, zerotron.checkpoint.export"
        baseline = [run_child([sys.executable, "-c", imports], env) for _ in range(2)]
        converts = {}
        for src, dtype in (("zero3", "fp32"), ("zero1", "fp32"), ("zero3", "bf16")):
            runs = []
            for i in range(min(args.repeats, 2) if (src, dtype) == ("zero3", "fp32") else 1):
                out = args.workdir / f"convert_{src}_{dtype}"
                shutil.rmtree(out, ignore_errors=True)
                r = run_child(
                    [
                        sys.executable,
                        "-m",
                        "zerotron.cli",
                        "convert",
                        str(args.workdir / src),
                        str(out),
                        "--dtype",
                        dtype,
                    ],
                    env,
                )
                if r["rc"]:
                    raise SystemExit(f"convert failed: {r['output']}")
                r["out_bytes"] = (out / "model.safetensors").stat().st_size
                runs.append(r)
            converts[f"{src}_{dtype}"] = runs
        # the pitfall above, measured: the same convert started straight from this (torch-importing) process
        naive = run_child(
            [
                sys.executable,
                "-m",
                "zerotron.cli",
                "convert",
                str(args.workdir / "zero3"),
                str(args.workdir / "convert_naive"),
            ],
            env,
            launcher=False,
        )
        naive["driver_vmhwm_bytes"] = proc_status()["VmHWM"]
        probes = {}
        for backend in ("mmap", "pread"):
            probe = run_child(
                [
                    sys.executable,
                    str(HERE),
                    "--phase",
                    "probe",
                    "--probe-src",
                    str(args.workdir / "zero3"),
                    "--probe-out",
                    str(args.workdir / f"convert_probe_{backend}"),
                    "--probe-largest",
                    facts["largest_tensor"],
                    *(["--probe-pread"] if backend == "pread" else []),
                ],
                env,
            )
            if probe["rc"]:
                raise SystemExit(f"probe failed: {probe['output']}")
            probes[backend] = json.loads(probe["output"].strip().splitlines()[-1])
            probes[backend]["process_maxrss_bytes"] = probe["maxrss_bytes"]
        probe_report = probes["mmap"]

        # the converted weights equal the saved model's
        from safetensors.torch import load_file

        ref = torch.load(args.workdir / "full_zero3.0.pt", weights_only=True)
        got = load_file(str(args.workdir / "convert_zero3_fp32" / "model.safetensors"))
        convert_diff = max((got[k] - ref[k]).abs().max().item() for k in ref)
        missing = sorted(set(ref) - set(got))
        del ref, got
    finally:
        if created and not args.keep:
            shutil.rmtree(args.workdir, ignore_errors=True)

    base_rss = statistics.median(b["maxrss_bytes"] for b in baseline)
    rows = []
    for key, runs in converts.items():
        peak = statistics.median(r["maxrss_bytes"] for r in runs)
        rows.append(
            {
                "case": key,
                "seconds": statistics.median(r["seconds"] for r in runs),
                "peak_rss_mib": mib(peak),
                "net_mib": mib(peak - base_rss),
                "net_per_largest": (peak - base_rss) / facts["largest_fp32_bytes"],
                "net_per_model": (peak - base_rss) / facts["fp32_bytes"],
                "out_mib": mib(runs[0]["out_bytes"]),
            }
        )
    for r in (*baseline, naive, *(x for runs in converts.values() for x in runs)):
        r["output"] = r["output"][-2000:]

    # ---- report
    print()
    save_rows = []
    for s in STAGES:
        k = f"zero{s}"
        zt, pt = main["save"][k], main["torch"][k]
        save_rows.append(
            {
                "case": f"ZeRO-{s}, 2 ranks",
                "zt_save": zt["median_s"],
                "torch_save": pt["save_median_s"],
                "ratio": zt["median_s"] / pt["save_median_s"],
                "zt_mib": mib(zt["disk"]["bytes"]),
                "torch_mib": mib(pt["bytes"]),
                "sha": main["sha256"][k]["all_files_s"],
                "torch_load": pt["load_median_s"],
                "zt_peak": mib(max(g["peak"] for r in zt["rss_growth_per_rank"] for g in r)),
                "torch_peak": mib(max(g["peak"] for g in pt["save_rss_growth_rank0"])),
            }
        )
    common.print_table(
        save_rows,
        [
            ("case", "checkpoint", "{}"),
            ("zt_save", "save_checkpoint s", "{:.2f}"),
            ("torch_save", "torch.save s (rank 0)", "{:.2f}"),
            ("ratio", "zt/torch", "{:.2f}"),
            ("zt_mib", "zt MiB", "{:.1f}"),
            ("torch_mib", "torch MiB", "{:.1f}"),
            ("sha", "sha256 all files s", "{:.2f}"),
            ("torch_load", "torch.load s", "{:.2f}"),
            ("zt_peak", "zt save +RSS MiB/rank", "{:.1f}"),
            ("torch_peak", "torch.save +RSS MiB", "{:.1f}"),
        ],
    )
    print()
    loads = {**main["load"], **reload}
    load_rows = []
    for k, v in loads.items():  # memory: max over ranks; the first load also allocates the Adam state
        g = v["rss_growth_per_rank"]
        first = {x: mib(max(r[0][x] for r in g)) for x in ("peak", "anon", "file")}
        later = {
            x: mib(max(r[i][x] for r in g for i in range(1, len(r)))) if len(g[0]) > 1 else None
            for x in ("peak", "anon", "file")
        }
        load_rows.append(
            {
                "case": k,
                "median_s": v["median_s"],
                "n": len(v["seconds"]),
                "dw": v["max_abs_weight_diff"],
                "dl": v["max_rel_loss_diff"],
                **{f"first_{x}": y for x, y in first.items()},
                **{f"later_{x}": y for x, y in later.items()},
            }
        )
    common.print_table(
        load_rows,
        [
            ("case", "load_checkpoint", "{}"),
            ("median_s", "median s", "{:.2f}"),
            ("n", "n", "{}"),
            ("dw", "max |dw|", "{:.1e}"),
            ("dl", "next 2 losses rel diff", "{:.1e}"),
            ("first_peak", "1st load MiB/rank: +peak", "{:.1f}"),
            ("first_anon", "+anon", "{:.1f}"),
            ("first_file", "+file", "{:.1f}"),
            ("later_peak", "later loads: +peak", "{:.1f}"),
            ("later_anon", "+anon", "{:.1f}"),
            ("later_file", "+file", "{:.1f}"),
        ],
    )
    print(
        f"\nconvert: largest tensor {mib(facts['largest_fp32_bytes']):.2f} MiB, model {mib(facts['fp32_bytes']):.1f} "
        f"MiB fp32; baseline (imports only) peak RSS {mib(base_rss):.1f} MiB, wall "
        f"{statistics.median(b['seconds'] for b in baseline):.2f} s; converted == saved weights: max |d| "
        f"{convert_diff:.1e}, missing {missing}"
    )
    common.print_table(
        rows,
        [
            ("case", "convert", "{}"),
            ("seconds", "wall s", "{:.2f}"),
            ("peak_rss_mib", "peak RSS MiB", "{:.1f}"),
            ("net_mib", "- baseline MiB", "{:.1f}"),
            ("net_per_largest", "x largest", "{:.2f}"),
            ("net_per_model", "x model", "{:.3f}"),
            ("out_mib", "out MiB", "{:.1f}"),
        ],
    )
    big = probe_report["largest_param_samples"]
    base = probe_report["after_imports"]
    print(
        f"\ninstrumented convert ({probe_report['convert_in_process_s']:.2f} s in convert()): RssAnon above "
        f"after-imports, largest tensor {facts['largest_tensor']}:"
    )
    for s in big:
        print(
            f"  {s['where']:<36} anon +{mib(s['RssAnon'] - base['RssAnon']):7.2f} MiB   file "
            f"+{mib(s['RssFile'] - base['RssFile']):6.2f} MiB"
        )
    for backend, pr in probes.items():
        print(
            f"  {backend:>5}: {pr['convert_in_process_s']:.2f} s; peak during convert() +"
            f"{mib(pr['peak_growth_bytes']):.2f} MiB (VmHWM); max anon +{mib(pr['anon_delta_max_bytes']):.2f} MiB "
            f"({pr['peak_anon_sample']['where']} of {pr['peak_anon_sample']['param']}), max file-backed "
            f"+{mib(pr['file_delta_max_bytes']):.2f} MiB, of which mapped rank files "
            f"{mib(pr['rank_files_mapped_rss_max_bytes']):.2f} MiB (after convert returned: "
            f"{mib(pr['end']['rank_files_mapped_rss']):.2f}); process peak RSS {mib(pr['process_maxrss_bytes']):.1f} "
            "MiB"
        )
    print(
        f"  naive wait4 from the driver itself: ru_maxrss {mib(naive['maxrss_bytes']):.1f} MiB "
        f"(driver's own VmHWM {mib(naive['driver_vmhwm_bytes']):.1f} MiB)"
    )

    payload = {
        "benchmark": "checkpoint",
        "args": reporting.json_args(args),
        "model": facts,
        "environment": {
            **main["environment"],
            "loadavg_start": load_start,
            "loadavg_end": os.getloadavg()[0],
            "total_s": time.perf_counter() - t_start,
            "main_job_s": main_s,
            "reload_job_s": reload_s,
        },
        "save": main["save"],
        "torch_reference": main["torch"],
        "sha256": main["sha256"],
        "load": loads,
        "convert": {
            "baseline_runs": baseline,
            "baseline_peak_rss_bytes": base_rss,
            "runs": converts,
            "summary": rows,
            "max_abs_diff_vs_saved_weights": convert_diff,
            "missing": missing,
            "probes": probes,
            "naive_wait4_from_driver": naive,
        },
        "summary": {"save": save_rows, "load": load_rows},
    }
    path = reporting.write_json("checkpoint", payload, args.out)
    print(f"\nwrote {path} ({time.perf_counter() - t_start:.0f} s)")


def main():
    if "--phase" in sys.argv and "probe" in sys.argv:
        p = argparse.ArgumentParser()
        p.add_argument("--phase")
        p.add_argument("--probe-src")
        p.add_argument("--probe-out")
        p.add_argument("--probe-largest")
        p.add_argument("--probe-pread", action="store_true")
        return phase_probe(p.parse_args())
    args = parse_args()
    if args.phase == "main":
        return phase_main(args)
    if args.phase == "reload":
        return phase_reload(args)
    if "RANK" in os.environ:
        raise SystemExit("run bench/checkpoint.py with plain python: it launches its own torchrun jobs")
    return driver(args)


if __name__ == "__main__":
    main()
