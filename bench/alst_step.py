"""ALST training steps side by side: the same script (a Transformers Llama, Ulysses attention
registered with Transformers, UlyssesSPDataLoaderAdapter, the sequence ranks' losses combined) under
real DeepSpeed and under zerotron through the `deepspeed` alias, 2 gloo ranks, sp 2.

Each round starts both systems in turn (the order alternates), each times `--steps` steps after
`--warmup` between barriers and reports its median; the result is each system's median over rounds
and the paired ratio (zerotron / DeepSpeed, per round). DeepSpeed runs in its own interpreter
(`--ds-python`, e.g. a venv with deepspeed==0.19.8 and the same torch).

    python bench/alst_step.py --ds-python /path/to/ds-venv/bin/python [--seq 4096] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
ROOT = HERE.parent.parent


def worker(args):
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(ROOT))
    import deepspeed
    from deepspeed.runtime.sequence_parallel import ulysses_sp
    from transformers import LlamaConfig, LlamaForCausalLM

    from tools.alst_script import sequence_loss

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=8000,
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=args.seq,
        attn_implementation="sdpa",
    )
    model, sp = LlamaForCausalLM(config), dist.get_world_size()
    mpu = ulysses_sp.UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", sp, 1, seq_length_is_variable=True)
    ds_config = {
        "train_batch_size": 1,
        "zero_optimization": {"stage": args.stage},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
        "zero_allow_untested_optimizer": True,
    }
    engine, *_ = deepspeed.initialize(model=model, config=ds_config, mpu=mpu, model_parameters=model.parameters())
    g = torch.Generator().manual_seed(dist.get_rank())
    data = [
        {"input_ids": ids, "position_ids": torch.arange(args.seq)[None], "labels": ids}
        for ids in (torch.randint(0, 8000, (1, args.seq), generator=g) for _ in range(args.warmup + args.steps))
    ]
    loader = ulysses_sp.UlyssesSPDataLoaderAdapter(
        torch.utils.data.DataLoader(data, batch_size=None),
        sp_rank=mpu.get_sequence_parallel_rank(),
        sp_group=mpu.get_sequence_parallel_group(),
        sp_world_size=sp,
        device=torch.device("cpu"),
    )
    times, losses = [], []
    for i, batch in enumerate(loader):
        if i == args.warmup + args.steps:
            break
        dist.barrier()
        t0 = time.perf_counter()
        out = engine(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
        loss = sequence_loss(out.logits, batch["shift_labels"], mpu.get_sequence_parallel_group())
        engine.backward(loss)
        engine.step()
        dist.barrier()
        if i >= args.warmup:
            times.append((time.perf_counter() - t0) * 1e3)
            losses.append(loss.item())
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps({"median_ms": statistics.median(times), "losses": losses}), flush=True)
    dist.destroy_process_group()


def _launch(system: str, args) -> dict:
    python = args.ds_python if system == "ds" else sys.executable
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    if system == "zt":
        env.update(ZEROTRON_AS_DEEPSPEED="1", PYTHONPATH=str(ROOT))
    cmd = [python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(HERE), "--worker"]
    cmd += ["--seq", str(args.seq), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    cmd += ["--stage", str(args.stage)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    found = re.findall(r"RESULT (\{.*\})", done.stdout)
    if done.returncode or not found:
        raise SystemExit(f"{system} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return json.loads(found[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ds-python", default=os.environ.get("DS_PYTHON"))
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--stage", type=int, default=3)  # DeepSpeed 0.19.8 scales gradients right at ZeRO-3 only
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=str(HERE.parent / "results" / "alst_step.json"))
    args = p.parse_args()
    if args.worker:
        return worker(args)
    if not args.ds_python:
        raise SystemExit("--ds-python: the interpreter of an environment with DeepSpeed (or set DS_PYTHON)")
    rounds = []
    for r in range(args.rounds):
        order = ("zt", "ds") if r % 2 == 0 else ("ds", "zt")
        rounds.append({s: _launch(s, args) for s in order})
        print(f"round {r}: " + ", ".join(f"{s} {rounds[-1][s]['median_ms']:.0f} ms" for s in order), flush=True)
    medians = {s: statistics.median(x[s]["median_ms"] for x in rounds) for s in ("zt", "ds")}
    paired = statistics.median(x["zt"]["median_ms"] / x["ds"]["median_ms"] for x in rounds)
    loss_rel = max(abs(a - b) / abs(b) for x in rounds for a, b in zip(x["zt"]["losses"], x["ds"]["losses"]))
    print(f"median step: zerotron {medians['zt']:.0f} ms, DeepSpeed {medians['ds']:.0f} ms; paired zt/ds {paired:.3f}")
    payload = {"args": vars(args), "median_ms": medians, "paired_ratio_zt_over_ds": paired, "rounds": rounds}
    payload["max_loss_rel_diff"] = loss_rel
    Path(args.out).write_text(json.dumps(payload, indent=1))


if __name__ == "__main__":
    main()
