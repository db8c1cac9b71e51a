"""bench/checkpoint.py's torchrun jobs: the 2-rank job (phase_main: saves, torch.save reference, loads on 2
ranks) and the 1-rank job (phase_reload: the 2-rank checkpoints loaded on one rank)."""

from __future__ import annotations

import json
import os
import shutil
import statistics
import time

import torch
import torch.distributed as dist

from bench import common
from bench.checkpoint_measure import dir_bytes, mib, proc_status, reset_peak
from tools import reporting, training
from zerotron.checkpoint.files import rank_file, sha256
from zerotron.models.gpt import GPT, config_for
from zerotron.zero import consolidated_state_dict

STAGES = (1, 3)


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
