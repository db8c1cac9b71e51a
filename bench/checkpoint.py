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
   a torch-free launcher: see checkpoint_measure.LAUNCHER), next to the largest tensor, the model size and
   the peak RSS of a python that only imports torch + zerotron + safetensors; then two instrumented converts in one
   process each (probes of RssAnon / RssFile / mapped rank files around every parameter; the second
   with safetensors' pread backend instead of mmap) that say where the memory goes.

Loads read files the save just wrote, so they come from the page cache (warm), as do the converts.
"""

from __future__ import annotations

import argparse
import json
import os
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

from bench import common  # noqa: E402
from bench.checkpoint_measure import mib, model_facts, proc_status, run_child  # noqa: E402
from bench.checkpoint_phases import STAGES, phase_main, phase_reload  # noqa: E402
from bench.checkpoint_probe import phase_probe  # noqa: E402
from tools import processes, reporting  # noqa: E402


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


# ---- the driver (its measurements: checkpoint_measure.py; the phases it launches: checkpoint_phases.py,
# checkpoint_probe.py) ------------------------------------------------------------------------------------
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
