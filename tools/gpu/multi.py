"""What only several GPUs show: every sharded strategy against one process, on NCCL, one node.

    torchrun --standalone --nproc_per_node 8 -m tools.gpu.multi --out $OUT/gpu_multi.json
    torchrun --standalone --nproc_per_node 4 -m tools.gpu.multi --smoke      # the CPU: gloo, the same code

Each layout trains the reference GPT (or its mixture of experts) for a few steps on one global batch of
random tokens, the ranks splitting it as the layout does, and compares every step's loss with the same model
trained by one process on that whole batch (each rank computes it itself): ZeRO 0-3 over every rank, optimizer
and parameter offload, tensor x pipeline x data parallelism, 1F1B and interleaved schedules, Ulysses and ring
attention (24 tokens a chunk) in bf16, expert parallelism through the grouped GEMM in bf16. fp32 layouts must
agree within 1e-5 relative (TF32 off), bf16 within 2e-2. The layouts cover what one GPU cannot (docs/
correctness.md, "The GPU runbook"): NCCL's communicators, collectives and point-to-point, the strategies'
collectives, offload's side streams beside them. Rank 0 prints a table and writes the JSON; the exit status is
non-zero when a layout fails.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tools import reporting, training  # noqa: E402

STEPS, SEQ, ROWS = 3, 96, 8  # global batch: ROWS sequences of SEQ tokens (ring: 4 chunks of 24 at cp 2)
ADAMW = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-6, "weight_decay": 0.1}
MOE = dict(n_experts=4, top_k=2, expert_ffn=96, aux_loss_coef=0.0)
OFFLOAD = {"device": "cpu", "pin_memory": True}


class Layout(NamedTuple):
    model: dict  # the reference GPT's overrides
    sections: dict  # DeepSpeed config sections
    pp: int = 1  # pipeline stages
    chunks: int = 1  # virtual stages per pipeline stage
    sp: int = 1  # Ulysses
    cp: int = 1  # ring attention


def layouts(world: int) -> dict[str, Layout]:
    """The layouts `world` ranks fit."""
    one = {"zero_optimization": {"stage": 1}}
    bf16 = {**one, "bf16": {"enabled": True}}
    out = {f"zero{s}": Layout({}, {"zero_optimization": {"stage": s}}) for s in range(4)}
    out["offload_optimizer_zero2"] = Layout({}, {"zero_optimization": {"stage": 2, "offload_optimizer": OFFLOAD}})
    both = {"stage": 3, "offload_optimizer": OFFLOAD, "offload_param": OFFLOAD}
    out["offload_param_zero3"] = Layout({}, {"zero_optimization": both})
    if world % 4 == 0:
        out["tp2_pp2_1f1b"] = Layout({}, {**one, "tensor_parallel": {"autotp_size": 2}}, pp=2)
    if world % 2 == 0:
        out["pp2_interleaved"] = Layout(
            {"n_layer": 4}, {**one, "pipeline": {"schedule": "interleaved"}}, pp=2, chunks=2
        )
        out["ulysses2_bf16"] = Layout({}, bf16, sp=2)
        out["ring2_bf16"] = Layout({"n_kv_head": 2}, bf16, cp=2)
        out["ep2_grouped_bf16"] = Layout(MOE, {**bf16, "expert_parallel": {"enabled": True, "autoep_size": 2}})
    return out


def _model(overrides: dict):
    from zerotron.models.gpt import GPT, config_for

    torch.manual_seed(0)
    return GPT(config_for("tiny", max_seq_len=SEQ, **{"n_kv_head": 4, **overrides}))


def reference(overrides: dict, batches, device, bf16: bool) -> list[float]:
    """One process, the whole batch: plain PyTorch and the same AdamW (bf16: the weights in bf16 without fp32
    masters, which zerotron keeps: hence the looser bf16 tolerance)."""
    model = _model(overrides).to(device)
    if bf16:
        model = model.to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), fused=device.type == "cuda", **ADAMW)
    step = training.torch_step(model, opt, clip=1.0)
    return [step(x, y) for x, y in batches]


def run(layout: Layout, device) -> dict:
    import zerotron
    from zerotron.long_context.layout import SequenceSplit
    from zerotron.parallelize import to_pipeline

    world, rank = dist.get_world_size(), dist.get_rank()
    pp, sp, cp = layout.pp, layout.sp, layout.cp
    gas, bf16 = (4 if pp > 1 else 1), "bf16" in layout.sections
    model = _model(layout.model)
    if pp > 1:
        model = to_pipeline(model, pp, partition_method="type:_PipeBlock", num_virtual_stages=layout.chunks)
    dp = world // (pp * sp * cp * layout.sections.get("tensor_parallel", {}).get("autotp_size", 1))
    config = training.zerotron_config(ROWS // (dp * gas), 1.0, adamw=ADAMW, gas=gas, **layout.sections)
    if sp > 1:
        config["sequence_parallel_size"] = sp
    if cp > 1:
        config["zerotron"] = {"context_parallel_size": cp}
    engine, *_ = zerotron.initialize(model=model, config=config)
    dp, c = engine.topology.dp, engine.coords
    batches = training.make_batches(STEPS, ROWS, SEQ, 256, device=device)
    split = SequenceSplit.of(engine.topology, rank)
    losses = []
    for x, y in batches:
        x, y = (t.chunk(dp)[c.dp] for t in (x, y))
        if pp > 1:
            losses.append(engine.train_batch(iter(list(zip(x.chunk(gas), y.chunk(gas))))).item())
            continue
        loss = engine(split.take(x), split.take(y)) if sp * cp > 1 else engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(engine._mean_over_dp(loss.detach()).item())
    want = reference(layout.model, batches, device, bf16)
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses, want))
    return {"losses": losses, "reference": want, "max_loss_rel": worst, "ok": worst <= (2e-2 if bf16 else 1e-5)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="the CPU: gloo processes (torchrun's), the same layouts")
    p.add_argument("--layouts", default=None, help="comma-separated names (default: every layout the world fits)")
    p.add_argument("--out", type=Path, default=None, help="result JSON (default bench/results/gpu_multi.json)")
    args = p.parse_args(argv)
    import zerotron

    zerotron.init_distributed()
    cuda = torch.cuda.is_available() and not args.smoke
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    world, rank = dist.get_world_size(), dist.get_rank()
    chosen = layouts(world)
    if args.layouts:
        chosen = {k: v for k, v in chosen.items() if k in args.layouts.split(",")}
    results = {}
    for name, layout in chosen.items():
        try:
            results[name] = run(layout, device)
        except Exception as e:  # noqa: BLE001 - one layout failing is a finding, the others still run
            results[name] = {
                "ok": False,
                "error": f"{type(e).__name__}: {str(e)[:300]}",
                "trace": traceback.format_exc()[-800:],
            }
        dist.barrier()
    every = [None] * world
    dist.all_gather_object(every, {k: v["ok"] for k, v in results.items()})
    failed = sorted({k for r in every for k, ok in r.items() if not ok})
    if rank == 0:
        rows = [{"layout": k, "ok": str(v["ok"]), "rel": v.get("max_loss_rel"), "error": v.get("error", "")[:60]}
                for k, v in results.items()]  # fmt: skip
        columns = [
            ("layout", "layout", "{}"),
            ("ok", "ok", "{}"),
            ("rel", "max loss rel", "{:.1e}"),
            ("error", "", "{}"),
        ]
        print("\n".join(reporting.table_lines(rows, columns)), flush=True)
        payload = {"benchmark": "gpu_multi", "world": world, "device": str(device), "layouts": results,
                   "failed": failed, **reporting.environment()}  # fmt: skip
        path = reporting.write_json("gpu_multi", payload, args.out)
        print(f"{'FAILED: ' + ', '.join(failed) if failed else 'every layout matched one process'}; wrote {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)
