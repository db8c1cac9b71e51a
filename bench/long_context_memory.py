"""The longest sequence that trains under a fixed memory cap per rank, one process beside Ulysses over
2 and 4 ranks (ALST on a Transformers Llama with the tiled MLP and the tiled loss, ZeRO-3).

Each probe is one training step (forward, backward, AdamW step) at one sequence length in fresh
processes; a rank's memory is its peak resident set during the step minus its resident set just
before it (the model, optimizer and a warm-up step already paid for). The longest length whose
probe stays under `--cap-mib` on every rank is found by doubling, then bisecting to `--grain`
tokens. The model is small and its vocabulary large (32,000), as a long-context fine-tune's
activations and logits dominate its memory.

    python bench/long_context_memory.py [--cap-mib 600] [--sizes 1 2 4]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
HERE = Path(__file__).resolve()


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=1 << 20,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config)


def probe(seq: int, shards: int) -> dict:
    """On each rank: one step at `seq` tokens; its memory above the resident set before the step."""
    import torch.distributed as dist

    import zerotron as deepspeed
    from tools.alst_script import TiledLossLM, tiled_mlp_forward
    from zerotron.compat import sequence_parallel as ulysses_sp

    deepspeed.init_distributed()
    sp, model = dist.get_world_size(), _model()
    from transformers.models.llama import modeling_llama

    modeling_llama.LlamaMLP.forward = tiled_mlp_forward(ulysses_sp.TiledMLP, shards)
    mpu = ulysses_sp.UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", sp, 1) if sp > 1 else None
    config = {"train_batch_size": 1, "zero_optimization": {"stage": 3}, "optimizer": {"type": "AdamW"}}
    lm = TiledLossLM(model, ulysses_sp.TiledFusedLogitsLoss, shards)
    engine, *_ = deepspeed.initialize(model=lm, config=config, mpu=mpu, model_parameters=lm.parameters())

    def step(length):
        g = torch.Generator().manual_seed(length)
        ids = torch.randint(0, 32000, (1, length), generator=g)
        batch = _split(ids, sp, dist.get_rank())
        total = engine(batch["input_ids"], batch["position_ids"], batch["shift_labels"])
        if sp > 1:
            total = torch.distributed.nn.functional.all_reduce(total, group=mpu.get_sequence_parallel_group())
        engine.backward(total / length)
        engine.step()

    step(256 * sp)  # warm-up: optimizer states and allocator pools exist before the measured step
    before = _rss_mib()
    step(seq)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"rank": dist.get_rank(), "mib": peak - before}


def _split(ids, sp, rank):
    from zerotron.long_context import shard_batch

    return shard_batch({"input_ids": ids, "labels": ids}, rank, sp)


def _launch(sp: int, seq: int, shards: int, timeout: float = 900) -> float | None:
    """The most MiB a rank added for a step at `seq` tokens over `sp` ranks (None: it failed)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(sp)]
    cmd += [str(HERE), "--probe", str(seq), "--shards", str(shards)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(HERE.parent.parent))
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    rows = [json.loads(m) for m in re.findall(r"PROBE (\{[^}]*\})", done.stdout)]  # ranks' lines may interleave
    return max(r["mib"] for r in rows) if done.returncode == 0 and len(rows) == sp else None


def longest(sp: int, cap: float, grain: int, shards: int) -> tuple[int, list]:
    """Doubling from 4096 tokens, then bisection to `grain`: the longest length under `cap`."""
    probes, fits, seq = [], 0, 4096
    while True:
        mib = _launch(sp, seq, shards)
        probes.append((seq, mib))
        if mib is None or mib > cap:
            break
        fits, seq = seq, seq * 2
    low, high = fits, seq
    while high - low > grain:
        mid = (low + high) // 2 // grain * grain
        mib = _launch(sp, mid, shards)
        probes.append((mid, mib))
        low, high = (mid, high) if mib is not None and mib <= cap else (low, mid)
    return low, probes


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cap-mib", type=float, default=600)
    p.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--grain", type=int, default=1024)
    p.add_argument("--shards", type=int, default=8, help="tiles of the MLP and the loss")
    p.add_argument("--probe", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=str(HERE.parent / "results" / "long_context_memory.json"))
    args = p.parse_args()
    if args.probe is not None:
        print("PROBE " + json.dumps(probe(args.probe, args.shards)), flush=True)
        return
    result = {"cap_mib": args.cap_mib, "shards": args.shards, "torch": torch.__version__, "longest": {}}
    for sp in args.sizes:
        seq, probes = longest(sp, args.cap_mib, args.grain, args.shards)
        result["longest"][sp] = {"tokens": seq, "probes": probes}
        print(f"sp {sp}: longest sequence under {args.cap_mib:g} MiB per rank: {seq} tokens  {probes}", flush=True)
    base = result["longest"][args.sizes[0]]["tokens"]
    for sp in args.sizes[1:]:
        print(f"sp {sp}: {result['longest'][sp]['tokens'] / base:.2f}x the one-process length")
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
