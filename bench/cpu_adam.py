"""CPU optimizer step for offloaded fp32 master weights: zerotron's CPUAdam vs torch AdamW and DeepSpeedCPUAdam.

    python bench/cpu_adam.py                          # flat shards of 2^24 and 2^26 elements + the GPT layout
    python bench/cpu_adam.py --layout flat --numel 2^24 --rounds 20
    python bench/cpu_adam.py --layout gpt             # per-parameter: the tensors of a 124M GPT
    python bench/cpu_adam.py --no-deepspeed

One process, every system on all cores. The workload is the host side of ZeRO-Offload: fp32 masters, a fresh
gradient each step (--grads of them, in turn, assigned before the clock starts), AdamW; `flat`: one master
shard of --numel elements; `gpt`: one tensor per parameter of GPT --gpt-size (tied, --vocab).

Systems: zt (zerotron.ops.adam.CPUAdam, bf16 copy fused via copy_out), zt_bf16 (the same, reading bf16
gradients in offload mode, as zerotron's engine sends them), torch_foreach, torch_fused (the baseline) and ds
(DeepSpeedCPUAdam; skipped with the reason when it does not load); the peers copy to bf16 after the
step. Modes, alternating in rounds: `step`, `step+bf16`, and `offload`: the whole host side of an
offloaded bf16 step with clipping, each system as its engine does it, the gradients' norms taken on the
device by both (zerotron: fp32 gradients (zt) or bf16 ones (zt_bf16) read where they arrived, then
unscale, clip, Adam and the bf16 copy in one pass per chunk; the peers as DeepSpeed: fp32 gradients, one
unscale-and-clip pass, the step, the copy). Check: after
the warm-up and at the end, one more step+bf16 step; masters against torch_fused's, each bf16 output
against its own master rounded.
The systems: cpu_adam_systems.py. Details: bench/README.md. Results: bench/results/cpu_adam.json.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import traceback
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from bench import common  # noqa: E402
from bench.cpu_adam_systems import ADAMW, ZEROTRON, System, clip_coefficients, deepspeed_status  # noqa: E402
from tools import reporting  # noqa: E402

BASELINE = "torch_fused"
MODES = ("step", "step+bf16", "offload")
ALL_SYSTEMS = ("zt", "zt_bf16", "torch_foreach", "torch_fused", "ds")


def parse_numel(text: str) -> int:
    text = text.strip()
    if "^" in text:
        base, exp = text.split("^")
        return int(base) ** int(exp)
    return int(float(text))


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layout", choices=("flat", "gpt", "both"), default="both")
    p.add_argument("--numel", default="2^24,2^26", help="flat shard sizes, comma-separated (2^24, 16777216, 1.6e7)")
    p.add_argument("--gpt-size", default="125m", help="zerotron.models.gpt size for --layout gpt")
    p.add_argument("--vocab", type=int, default=50304, help="vocabulary of the GPT layout")
    p.add_argument("--steps", type=int, default=3, help="timed steps per system and mode per round")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per system and mode first")
    p.add_argument("--grads", type=int, default=3, help="distinct random gradients, used in turn")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--systems", default=",".join(ALL_SYSTEMS))
    p.add_argument("--zt-chunk", default=None, help="CPUAdam's chunk_numel (default: its own, 2^19)")
    p.add_argument("--no-deepspeed", action="store_true")
    p.add_argument("--out", type=Path, default=None)
    return p.parse_args()


# ---- workloads --------------------------------------------------------------------------------------
def gpt_shapes(size: str, vocab: int) -> tuple[list[torch.Size], str]:
    from zerotron.models.gpt import GPT, config_for

    cfg = config_for(size, vocab_size=vocab, tie_embeddings=True)
    with torch.device("meta"):
        model = GPT(cfg)
    shapes = [p.shape for p in model.parameters()]  # tied weights appear once
    desc = (
        f"zerotron GPT {size!r}: {cfg.n_layer} layers, d_model {cfg.d_model}, ffn {cfg.ffn}, vocab {vocab}, "
        f"tied embeddings"
    )
    return shapes, desc


def make_tensors(shapes, n_grads: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    init = [torch.randn(s, generator=g).mul_(0.02) for s in shapes]
    # bf16 values (in fp32 tensors): zerotron's offload receives them in bf16, the peers in fp32
    grads = [[torch.randn(s, generator=g).mul_(1e-2).bfloat16().float() for s in shapes] for _ in range(n_grads)]
    return init, grads


def compare(systems: dict[str, System]) -> dict:
    """Masters vs the baseline's; each bf16 output vs its own master rounded."""
    ref = systems[BASELINE]
    ref_max = max(p.detach().abs().max().item() for p in ref.params)
    out = {}
    for name, s in systems.items():
        diff = max((a.detach() - b.detach()).abs().max().item() for a, b in zip(s.params, ref.params))
        identical = all(torch.equal(a.detach(), b.detach()) for a, b in zip(s.params, ref.params))
        bf16_ok = all(torch.equal(o, p.detach().to(torch.bfloat16)) for o, p in zip(s.bf16, s.params))
        bf16_vs_ref = sum(int((o != r).sum()) for o, r in zip(s.bf16, ref.bf16))
        out[name] = {
            "steps": s.n,
            "max_abs_diff": diff,
            "max_rel_diff": diff / ref_max,
            "bit_identical": identical,
            "bf16_equals_own_master": bf16_ok,
            "bf16_elements_differing_from_baseline": bf16_vs_ref,
        }
    return out


def check(systems: dict[str, System]) -> dict:
    for s in systems.values():
        s.prepare("step+bf16")
        s.step("step+bf16")
    return compare(systems)


def run_case(label: str, shapes, args, names: list[str], ds_cls) -> dict:
    numel = sum(torch.Size(s).numel() for s in shapes)
    print(f"\n== {label}: {numel:,} elements in {len(shapes)} tensor(s) ==", flush=True)
    init, grads = make_tensors(shapes, args.grads)
    coefs = clip_coefficients(grads)
    chunk = parse_numel(args.zt_chunk) if args.zt_chunk else None
    systems = {n: System(n, init, grads, coefs, ds_cls, chunk) for n in names}
    del init
    entries = [(n, m) for n in names for m in MODES]
    for n, m in entries:
        for _ in range(args.warmup):
            systems[n].prepare(m)
            systems[n].step(m)
    check_warmup = check(systems)
    round_load = []  # 1-minute load average after each round: this one process accounts for ~threads of it

    def on_round(r, round_ms):
        round_load.append(os.getloadavg()[0])
        print(
            f"round {r + 1}/{args.rounds} (load {round_load[-1]:.1f}): "
            + ", ".join(f"{n}/{m} {round_ms[(n, m)][-1]:.1f}" for n, m in entries),
            flush=True,
        )

    # each system runs its modes in one order (only offload clips), so all take the same steps, bit for bit
    ms, round_ms = common.rounds(
        entries, lambda e: systems[e[0]].timed(e[1]), args.rounds, args.steps, on_round, block=len(MODES)
    )
    check_end = check(systems)

    rows = []
    for n, m in entries:
        med = statistics.median(ms[(n, m)])
        rows.append(
            {
                "system": n,
                "mode": m,
                "median_ms": med,
                "elements_per_s": numel / (med / 1e3),
                "min_ms": min(ms[(n, m)]),
                "ms": ms[(n, m)],
                "round_ms": round_ms[(n, m)],
            }
        )
    med = {(r["system"], r["mode"]): r["median_ms"] for r in rows}
    pairs = [
        {
            "pair": f"{zt}/{peer}",
            "mode": m,
            "ratio": med[(zt, m)] / med[(peer, m)],
            "paired": statistics.median(a / b for a, b in zip(round_ms[(zt, m)], round_ms[(peer, m)])),
        }
        for zt in ZEROTRON
        if zt in names
        for peer in names
        if peer not in ZEROTRON
        for m in (MODES if zt == "zt" else ("offload",))
    ]

    print(f"\n{label}: {numel:,} elements, {len(shapes)} tensor(s), {args.threads} threads")
    common.print_table(
        [{**r, "meps": r["elements_per_s"] / 1e6} for r in rows],
        [
            ("system", "system", "{}"),
            ("mode", "mode", "{}"),
            ("median_ms", "median ms", "{:.2f}"),
            ("min_ms", "min ms", "{:.2f}"),
            ("meps", "M elem/s", "{:.0f}"),
        ],
    )
    if pairs:
        print()
        common.print_table(
            pairs,
            [
                ("pair", "pair", "{}"),
                ("mode", "mode", "{}"),
                ("ratio", "ratio", "{:.3f}"),
                ("paired", "paired", "{:.3f}"),
            ],
        )
    for when, c in (("after warm-up", check_warmup), ("at the end", check_end)):
        print(f"\ncheck {when} (vs {BASELINE}, after {c[BASELINE]['steps']} steps):")
        common.print_table(
            [{"system": n, **v} for n, v in c.items()],
            [
                ("system", "system", "{}"),
                ("max_abs_diff", "max|diff|", "{:.3g}"),
                ("max_rel_diff", "rel", "{:.3g}"),
                ("bit_identical", "identical", "{}"),
                ("bf16_equals_own_master", "bf16 ok", "{}"),
                ("bf16_elements_differing_from_baseline", "bf16 != base", "{}"),
            ],
        )
    result = {
        "case": label,
        "numel": numel,
        "tensors": len(shapes),
        "rows": rows,
        "pairs": pairs,
        "round_load": round_load,
        "check_after_warmup": check_warmup,
        "check_end": check_end,
    }
    systems.clear()
    del grads
    gc.collect()
    return result


def main():
    args = parse_args()
    torch.set_num_threads(args.threads)
    names = common.names_arg(args.systems, ALL_SYSTEMS)
    if BASELINE not in names:
        names.append(BASELINE)
    ds_cls, ds_skip = None, ""
    if "ds" in names:
        if args.no_deepspeed:
            ds_skip = "--no-deepspeed"
        else:
            ds_cls, ds_skip = deepspeed_status()
        if ds_cls is None:
            names.remove("ds")
            print(f"DeepSpeedCPUAdam skipped: {ds_skip}")

    env = reporting.environment(
        deepspeed=getattr(sys.modules.get("deepspeed"), "__version__", None),
        torch_threads=torch.get_num_threads(),
        OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS"),
        cpu_capability=torch.backends.cpu.get_cpu_capability(),
    )
    try:
        import cpuinfo

        env["cpu"] = cpuinfo.get_cpu_info().get("brand_raw")
    except Exception:
        pass
    print(f"systems: {', '.join(names)}; {args.threads} threads; torch {torch.__version__}")

    cases = []
    if args.layout in ("flat", "both"):
        for text in args.numel.split(","):
            n = parse_numel(text)
            cases.append((f"flat 2^{n.bit_length() - 1}" if n & (n - 1) == 0 else f"flat {n}", [torch.Size([n])], None))
    if args.layout in ("gpt", "both"):
        shapes, desc = gpt_shapes(args.gpt_size, args.vocab)
        cases.append((f"gpt {args.gpt_size}", shapes, desc))
    results = []
    for label, shapes, desc in cases:
        try:
            res = run_case(label, shapes, args, list(names), ds_cls)
        except Exception:
            traceback.print_exc()
            res = {"case": label, "error": traceback.format_exc()}
        if desc:
            res["layout"] = desc
        results.append(res)

    path = reporting.write_json(
        "cpu_adam",
        {
            "benchmark": "cpu_adam",
            "args": reporting.json_args(args),
            "adamw": {**ADAMW, "betas": list(ADAMW["betas"])},
            "baseline": BASELINE,
            "systems": names,
            "deepspeed_skipped": ds_skip or None,
            "environment": {**env, "loadavg_end": os.getloadavg()[0]},
            "results": results,
        },
        args.out,
    )
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
