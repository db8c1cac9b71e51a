"""The autotuner's search, predicted: the ZeRO stage and micro-batch that DeepSpeed's autotuner would find by
running a dozen or more short trials, chosen from the planner's memory and step-time model without running any.

For each allowed ZeRO stage, the largest micro-batch that fits (memory grows with the micro-batch, so a
bisection finds it), capped by the tuning bounds and the global batch; then the stage whose best micro-batch
gives the best predicted metric. A fixed global batch (`train_batch`) allows only the micro-batches that divide
it over the data-parallel ranks, with gradient accumulation making up the rest, as DeepSpeed's batch arithmetic
requires. A higher stage must be predicted 5% better than a lower one to be chosen (less communication and
fewer moving parts for nearly the same speed).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .cost import fits, memory, throughput
from .hardware import GIB, Hardware
from .layout import Layout
from .model import ModelShape

METRICS = ("throughput", "latency", "flops")
# A higher ZeRO stage is chosen only when predicted this much better than a lower one: the gain DeepSpeed's
# autotuner asks of a trial (METRIC_PERCENT_DIFF_CONST), which here also absorbs the cost model's error.
MARGIN = 0.05


@dataclass(frozen=True)
class Trial:
    """One (stage, micro-batch) the tuner costed: memory per GPU, predicted speed, why it does not fit."""

    layout: Layout
    memory: dict
    speed: dict
    rejected: str | None

    def describe(self) -> str:
        fit = "fits" if self.rejected is None else f"does not fit: {self.rejected}"
        return (
            f"ZeRO-{self.layout.zero} micro-batch {self.layout.micro_batch} x {self.layout.grad_accum}: "
            f"{self.memory['total'] / GIB:.2f} GiB per GPU, {self.speed['tokens_per_s']:.0f} tokens/s predicted ({fit})"
        )


def _better(a: Trial, b: Trial, metric: str) -> bool:
    """Whether `a` beats `b` by the margin. Throughput and flops rank alike (the FLOPs per token do not depend on
    the layout); latency is the step time."""
    if metric == "latency":
        return a.speed["step_s"] < b.speed["step_s"] * (1 - MARGIN)
    return a.speed["tokens_per_s"] > b.speed["tokens_per_s"] * (1 + MARGIN)


def _micro_batches(
    dp: int, lo: int, hi: int, train_batch: int | None, gas: int | None, max_train_batch: int | None
) -> list[tuple[int, int]]:
    """(micro-batch, accumulation) pairs the batch arithmetic allows, smallest micro-batch first."""
    if train_batch is not None:
        pairs = [(m, train_batch // (m * dp)) for m in range(lo, hi + 1) if train_batch % (m * dp) == 0]
        return [(m, g) for m, g in pairs if gas is None or g == gas]
    gas = gas or 1
    if max_train_batch is not None:
        hi = min(hi, max_train_batch // (gas * dp))
    return [(m, gas) for m in range(lo, hi + 1)]


def tune(
    shape: ModelShape,
    gpus: int,
    hw: Hardware,
    seq: int,
    dtype: str = "bf16",
    stages: tuple[int, ...] = (0, 1, 2, 3),
    tp: int = 1,
    min_micro_batch: int = 1,
    max_micro_batch: int = 1024,
    train_batch: int | None = None,
    gas: int | None = None,
    max_train_batch: int | None = None,
    metric: str = "throughput",
) -> tuple[Trial, list[Trial]]:
    """The best trial and every trial costed (each stage's largest fitting micro-batch, and the smallest
    micro-batch that does not fit, for the report). Raises ValueError when no micro-batch fits at any stage."""
    if metric not in METRICS:
        raise ValueError(f"autotuning.metric is one of {', '.join(METRICS)}, not {metric!r}")
    if gpus % tp:
        raise ValueError(f"the tensor-parallel size ({tp}) must divide the GPU count ({gpus})")
    dp = gpus // tp
    pairs = _micro_batches(dp, max(1, min_micro_batch), max_micro_batch, train_batch, gas, max_train_batch)
    if not pairs:
        raise ValueError(
            f"no micro-batch between {min_micro_batch} and {max_micro_batch} splits the global batch "
            f"({train_batch}) over {dp} data-parallel ranks; change train_batch_size or the tuning bounds"
        )
    trials: list[Trial] = []
    best: Trial | None = None
    for stage in stages:
        base = Layout(dp=dp, tp=tp, zero=stage)

        def cost(i: int) -> Trial:
            layout = replace(base, micro_batch=pairs[i][0], grad_accum=pairs[i][1])
            mem = memory(shape, layout, seq, dtype)
            return Trial(layout, mem, throughput(shape, layout, seq, hw, dtype), fits(mem, hw, hw.gpus_per_node))

        # the largest index that fits: memory grows with the micro-batch
        lo, hi = 0, len(pairs) - 1
        first = cost(0)
        if first.rejected is not None:
            trials.append(first)
            continue
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if cost(mid).rejected is None:
                lo = mid
            else:
                hi = mid - 1
        fitting = cost(lo)
        trials.append(fitting)
        if lo + 1 < len(pairs):
            trials.append(cost(lo + 1))
        if best is None or _better(fitting, best, metric):
            best = fitting
    if best is None:
        smallest = min(trials, key=lambda t: t.memory["total"])
        raise ValueError(
            f"no micro-batch fits at ZeRO stage {', '.join(map(str, stages))}: the smallest, "
            f"{smallest.describe()}; train on more GPUs, offload the optimizer, or shorten the sequences"
        )
    return best, trials
