"""Pipeline parallelism side by side: zerotron vs torch.distributed.pipelining, one job, 2 gloo ranks.

    python bench/pp.py                       # re-executes itself under torchrun --standalone, 2 ranks = 2 stages
    python bench/pp.py --micro-batches 8 --batch 16
    python bench/pp.py --schedules 1f1b --rounds 30
    python bench/pp.py --nproc 4             # 4 pipeline stages (needs --layers >= 4)
    python bench/pp.py --balanced --schedules 1f1b,zb-h1   # stages of blocks only (equal cost)

Pipeline size = world size; a step is one global batch of --batch sequences in --micro-batches equal
micro-batches (stage 0 reads the tokens, the last stage the targets). Same seeded GPT, batches, fused AdamW
and clipping (default off) for every system. Both sides cut the model alike (stage_bounds) and wrap each block
to take one tensor, as zerotron's _PipeBlock does. --balanced: every stage holds transformer blocks only (no
embedding, no head); stage 0 reads seeded hidden states and makes them a leaf that requires grad (InputLeaf), so
it computes its input's gradient as every other stage does; the last stage's loss is the mean squared error to
seeded targets: stages of equal cost, as the bubble's theory assumes.

  zt_<schedule>     to_pipeline + zerotron.initialize(pipeline.schedule gpipe / 1f1b / zb-h1);
                    a step = engine.train_batch(iter(micro-batches))
  torch_<schedule>  PipelineStage + ScheduleGPipe / Schedule1F1B / ScheduleInterleavedZeroBubble (one stage
                    per rank: the same ZB-H1 order) with scale_grads=True, then AdamW; the mean micro-batch
                    loss broadcast from the last stage, as train_batch returns it

Pairs: zt_<schedule> vs torch_<schedule>. Also zerotron's bubble (engine.pipeline_bubble()): measured, the
theory, and the batch replayed on ideal stages with its actions' measured times (what the engine itself adds
is measured minus replayed), for the last timed batch and over --bubble-batches extra batches. Details:
bench/README.md.
"""

from __future__ import annotations

import os
import statistics
import sys
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from bench import common  # noqa: E402
from tools import training  # noqa: E402

warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
warnings.filterwarnings("ignore", category=UserWarning, module="torch.distributed.pipelining")

SCHEDULES = ("gpipe", "1f1b", "zb-h1")
BASELINE = "torch_gpipe"


def parse_args():
    p = common.base_parser(__doc__.splitlines()[0], steps=2, rounds=20)
    next(a for a in p._actions if a.dest == "batch").help = "sequences per step (all micro-batches together)"
    p.add_argument("--micro-batches", type=int, default=4, help="micro-batches per step (gradient accumulation)")
    p.add_argument("--clip", type=float, default=0.0, help="gradient clipping max norm for every system (0: off)")
    p.add_argument("--schedules", default="gpipe,1f1b", help=f"comma-separated subset of {','.join(SCHEDULES)}")
    p.add_argument(
        "--bubble-batches",
        type=int,
        default=5,
        help="extra untimed zerotron batches after the rounds whose measured bubbles are reported",
    )
    p.add_argument(
        "--balanced",
        action="store_true",
        help="stages of transformer blocks only (hidden states in, mean squared error out): equal stages",
    )
    return p.parse_args()


def stage_bounds(n_layer: int, stages: int) -> list[int]:
    """Block boundaries per stage: as even as possible, earlier stages one more (zerotron's 'type:' split)."""
    base, extra = divmod(n_layer, stages)
    bounds = [0]
    for s in range(stages):
        bounds.append(bounds[-1] + base + (s < extra))
    return bounds


def hidden_batches(args, cfg):
    """--balanced: per step, seeded hidden states and seeded targets for the mean squared error, shaped
    (batch, seq, d_model)."""
    g = torch.Generator().manual_seed(1234)
    shape = (args.batch, args.seq, cfg.d_model)
    return [
        (torch.randn(shape, generator=g), torch.randn(shape, generator=g))
        for _ in range(args.warmup + args.rounds * args.steps)
    ]


def median_per_stage(bubbles: list[dict], key: str, stages: int) -> list[float] | None:
    return [statistics.median(b[key][s] for b in bubbles) for s in range(stages)] if bubbles else None


def micro_split(tokens, targets, m):
    """The micro-batches torch's schedule cuts (tensor_split along dim 0), so both sides see the same."""
    return list(zip(tokens.tensor_split(m), targets.tensor_split(m)))


# ---- zerotron -------------------------------------------------------------------------------------
def mse(output, target):
    return nn.functional.mse_loss(output, target)


class InputLeaf(nn.Module):
    """--balanced, first on stage 0: the hidden states as a leaf that requires grad, as a received
    activation is on every other stage (their gradient is computed and dropped)."""

    def forward(self, x):
        return x.detach().requires_grad_()


def zerotron_system(cfg, args, stages, schedule):
    if args.balanced:  # the GPT's blocks alone, cut as the torch stages are
        from zerotron.pipe import PipelineModule

        gpt = common.build_gpt(cfg)
        module = PipelineModule(
            [InputLeaf(), *(RotaryBlock(b, cfg) for b in gpt.layers)],
            num_stages=stages,
            loss_fn=mse,
            partition_method="type:_PipeBlock",
        )
    else:
        module = common.to_pipeline(common.build_gpt(cfg), stages, partition_method="type:_PipeBlock")
    engine, _ = training.zerotron_step(
        module,
        args.batch // args.micro_batches,
        args.clip,
        gas=args.micro_batches,
        pipeline={"schedule": schedule},
        wall_clock_breakdown=True,
    )  # pipeline_bubble() needs the stage timing

    def step(tokens, targets):
        return engine.train_batch(iter(micro_split(tokens, targets, args.micro_batches))).item()

    return step, engine, common.measure_after_first_step(engine.optimizer, engine.module.parameters)


# ---- torch.distributed.pipelining -----------------------------------------------------------------
# One GPT block taking one tensor (cos/sin from x.shape[1]): the same layer zerotron's pipeline uses.
from zerotron.parallelize.gpt import _PipeBlock as RotaryBlock  # noqa: E402


class TorchStage(nn.Module):
    """Stage `stage` of the GPT: [embedding] + its blocks + [final norm + head] (`blocks_only`: its blocks)."""

    def __init__(self, gpt, stage, stages, blocks_only=False):
        super().__init__()
        lo, hi = stage_bounds(gpt.config.n_layer, stages)[stage : stage + 2]
        self.tok_emb = gpt.tok_emb if stage == 0 and not blocks_only else None
        self.layers = nn.ModuleList(
            ([InputLeaf()] if stage == 0 and blocks_only else [])
            + [RotaryBlock(b, gpt.config) for b in gpt.layers[lo:hi]]
        )
        last = stage == stages - 1 and not blocks_only
        self.norm = gpt.norm if last else None
        self.lm_head = gpt.lm_head if last else None

    def forward(self, x):
        if self.tok_emb is not None:
            x = self.tok_emb(x)
        for layer in self.layers:
            x = layer(x)
        if self.lm_head is not None:
            x = self.lm_head(self.norm(x))
        return x


def torch_system(cfg, args, stage, stages, schedule):
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleavedZeroBubble
    from torch.nn.utils import clip_grads_with_norm_, get_total_norm

    from zerotron.models.gpt import cross_entropy

    gpt = common.build_gpt(cfg)
    if gpt.config.tie_embeddings:
        raise SystemExit("tied embeddings are not benchmarked")
    model = TorchStage(gpt, stage, stages, blocks_only=args.balanced)
    del gpt
    mb = args.batch // args.micro_batches
    hidden = torch.empty(mb, args.seq, cfg.d_model, requires_grad=True)  # activations carry gradients back
    inputs = torch.zeros(mb, args.seq, dtype=torch.long) if stage == 0 and not args.balanced else hidden
    outputs = torch.empty(mb, args.seq, cfg.vocab_size) if stage == stages - 1 and not args.balanced else hidden
    pipe_stage = PipelineStage(model, stage, stages, torch.device("cpu"), input_args=inputs, output_args=outputs)
    loss_fn = mse if args.balanced else cross_entropy
    if schedule == "zb-h1":  # torch's zero-bubble schedule with one stage per rank runs ZB-H1's order
        sched = ScheduleInterleavedZeroBubble(
            [pipe_stage], n_microbatches=args.micro_batches, loss_fn=loss_fn, scale_grads=True
        )
    else:
        kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule]
        sched = kind(pipe_stage, n_microbatches=args.micro_batches, loss_fn=loss_fn, scale_grads=True)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, fused=True, **training.ADAMW)
    first, last = stage == 0, stage == stages - 1

    def step(tokens, targets):
        losses = []
        if first and last:
            sched.step(tokens, target=targets, losses=losses, return_outputs=False)
        elif first:
            sched.step(tokens, return_outputs=False)
        elif last:
            sched.step(target=targets, losses=losses, return_outputs=False)
        else:
            sched.step(return_outputs=False)
        if args.clip > 0:  # the global norm over every stage's parameters
            sq = get_total_norm([p.grad for p in params if p.grad is not None]).square()
            dist.all_reduce(sq)
            clip_grads_with_norm_(params, args.clip, sq.sqrt())
        opt.step()
        opt.zero_grad()
        loss = torch.stack(losses).mean() if last else torch.zeros(())
        dist.broadcast(loss, src=stages - 1)  # every rank returns the loss, as zerotron's train_batch
        return loss.item()

    return step, common.measure_after_first_step(opt, model.parameters)


def main():
    args = parse_args()
    rank, world, log, cfg = common.start(args)
    stages = world
    schedules = common.names_arg(args.schedules, SCHEDULES, "schedules")
    if args.batch % args.micro_batches:
        raise SystemExit(f"--batch {args.batch} must be divisible by --micro-batches {args.micro_batches}")
    if args.layers < stages:
        raise SystemExit(f"--layers {args.layers} must be at least the {stages} pipeline stages")
    if "1f1b" in schedules and args.micro_batches < stages:
        raise SystemExit(f"torch's Schedule1F1B needs --micro-batches >= the {stages} stages")
    if "zb-h1" in schedules and args.micro_batches % max(1, args.micro_batches // stages):
        raise SystemExit(
            f"torch's zero-bubble schedule needs --micro-batches a multiple of "
            f"{max(1, args.micro_batches // stages)} (its rounds of {stages})"
        )

    systems, memory, engines = {}, {}, {}
    for s in schedules:  # pairs next to each other in the round order
        systems[f"zt_{s}"], engines[f"zt_{s}"], memory[f"zt_{s}"] = zerotron_system(cfg, args, stages, s)
        systems[f"torch_{s}"], memory[f"torch_{s}"] = torch_system(cfg, args, rank, stages, s)
    parts = next(iter(engines.values())).module.parts
    blocks = stage_bounds(args.layers, stages)
    # zerotron's layers: [embedding, block 0..L-1, head] (balanced: [InputLeaf, block 0..L-1]); its cuts
    # must match the torch stages' block ranges.
    expected = (
        [0] + [b + 1 for b in blocks[1:]] if args.balanced else [0] + [b + 1 for b in blocks[1:-1]] + [args.layers + 2]
    )
    if list(parts) != expected:
        raise SystemExit(f"zerotron cut the layers at {parts}, the torch stages at {expected}")

    mb = args.batch // args.micro_batches
    common.announce(
        log,
        args,
        cfg,
        f"{stages} pipeline stages (blocks "
        f"{', '.join(f'{a}-{b - 1}' for a, b in zip(blocks, blocks[1:]))}"
        f"{', blocks only' if args.balanced else ''}), {args.batch} sequences/step = "
        f"{args.micro_batches} micro-batches of {mb}, fp32, clip {args.clip or 'off'}",
    )
    # One pipeline: every rank reads the same global batch (stage 0 uses the tokens, the last stage the targets).
    batches = hidden_batches(args, cfg) if args.balanced else common.batches_for(args, cfg)
    res = common.run_rounds(systems, batches, args.warmup, args.steps, args.rounds, log=log)

    # zerotron's bubble: the last timed batch, then the median over a few extra (untimed) batches.
    bubbles = {}
    for name, engine in engines.items():
        last = engine.pipeline_bubble()
        extra = []
        for tokens, targets in batches[: args.bubble_batches]:
            dist.barrier()
            systems[name](tokens, targets)
            extra.append(engine.pipeline_bubble())
        bubbles[name] = {
            "theory": last["theory"],
            "last_timed_batch": last["measured"],
            "median_extra_batches": median_per_stage(extra, "measured", stages),
            "replayed_median_extra_batches": median_per_stage(extra, "replayed", stages),
            "extra_batches": [b["measured"] for b in extra],
            "replayed_extra_batches": [b["replayed"] for b in extra],
        }

    def per_stage(values):
        return None if not values else " / ".join(f"{x:.3f}" for x in values)

    baseline = BASELINE if BASELINE in res else next(n for n in res if n.startswith("torch"))
    rows = list(common.compare(res, baseline).values())
    for r in rows:
        mem, b = memory[r["system"]], bubbles.get(r["system"])
        # state per rank differs between stages: report the largest.
        r.update(
            state_mb_max_stage=common.max_over_ranks(mem.get("total", 0)) / 2**20,
            memory_rank0=mem,
            bubble_last=b and per_stage(b["last_timed_batch"]),
            bubble_median=b and per_stage(b["median_extra_batches"]),
            bubble_replayed=b and per_stage(b["replayed_median_extra_batches"]),
            bubble_theory=b and b["theory"],
            bubble=b,
        )
    pairs = [
        {
            "schedule": s,
            "zerotron": f"zt_{s}",
            "torch": f"torch_{s}",
            "pair": f"zt_{s} / torch_{s}",
            **common.pair(res, f"zt_{s}", f"torch_{s}"),
        }
        for s in schedules
    ]
    if rank == 0:
        print()
        common.print_table(
            rows,
            [
                ("system", "system", "{}"),
                ("median_ms", "median ms", "{:.1f}"),
                ("loss_diff", f"max|dloss| vs {baseline}", "{:.1e}"),
                ("loss_rel_diff", "relative", "{:.1e}"),
                ("state_mb_max_stage", "state MiB (max stage)", "{:.2f}"),
                ("bubble_last", "bubble last batch (per stage)", "{}"),
                ("bubble_median", f"median of {args.bubble_batches} more", "{}"),
                ("bubble_replayed", "replayed", "{}"),
                ("bubble_theory", "theory", "{:.3f}"),
            ],
        )
        print()
        common.print_table(
            pairs,
            [
                ("pair", "zerotron / torch", "{}"),
                ("median_zt_ms", "zt ms", "{:.1f}"),
                ("median_torch_ms", "torch ms", "{:.1f}"),
                ("ratio", "ratio of medians", "{:.3f}"),
                ("paired", "paired", "{:.3f}"),
                ("loss_diff", "max|dloss|", "{:.1e}"),
            ],
        )
        print(
            "\nratio < 1: zerotron is faster. paired: median over rounds of the per-round ratio (prefer it on a "
            "shared machine). max|dloss| over every step, warm-up included. Bubble: zerotron's "
            "engine.pipeline_bubble(), idle fraction of each stage over the common window of a batch; theory "
            "(p-1)/(m+p-1), ZB-H1 (p-1)/(3m+p-1); replayed: the same batches on ideal stages (free transfers) "
            "whose every action takes its measured time, so measured - replayed is the engine's own idle time. "
            "State: params + grads + AdamW state after the first step, the largest stage."
        )
    common.finish(
        "pp",
        args,
        {
            "model": common.model_json(
                args,
                cfg,
                dtype="fp32",
                pipeline_stages=stages,
                stage_blocks=blocks,
                balanced=args.balanced,
                zerotron_layer_cuts=list(parts),
                micro_batches=args.micro_batches,
                micro_batch_size=mb,
            ),
            "adamw": {**training.ADAMW, "betas": list(training.ADAMW["betas"]), "fused": True},
            "baseline": baseline,
            "pairs": pairs,
            "results": rows,
        },
        rank,
    )


if __name__ == "__main__":
    main()
