"""Per-rank memory of the model states, from a model's shape and a parallel layout.

What each rank holds (Ψ = the parameters of its pipeline stage, after tensor parallelism; N = the
data-parallel size; b = bytes per element of the model dtype), as zerotron's engine lays it out:

    stage   params    gradients   fp32 masters (bf16/fp16 only)   optimizer (Adam: 2 fp32 moments)
    0       bΨ        bΨ          4Ψ (+ 4Ψ of their gradients)     8Ψ
    1       bΨ        bΨ          4Ψ/N                             8Ψ/N
    2       bΨ        bΨ/N        4Ψ/N                             8Ψ/N
    3       bΨ/N      bΨ/N        4Ψ/N                             8Ψ/N

With optimizer offload the masters (also in fp32 training), their fp32 gradients, a staging copy
in the model dtype and the optimizer states live in host memory instead. Stage 3 keeps parameters
under `stage3_param_persistence_threshold` whole on every rank.

Expert parallelism over `ep` of the N data-parallel ranks: each rank holds experts/ep of every block's
experts, and ZeRO shards their states over the N/ep ranks holding the same ones (the expert-data-parallel
group), so the table applies twice: to the dense tensors over N, to the rank's experts over N/ep (the
engine's shard groups, zero/shard_group.py). Fully sharded states (8Ψ/N) come out the same either way;
what expert parallelism saves is the experts' parameters and gradients ZeRO leaves whole (stages 0-2)
and the layer ZeRO-3 gathers.
"""

from __future__ import annotations

import functools
import math

from .model import ModelShape


@functools.lru_cache(maxsize=1024)
def stage_tensors(shape: ModelShape, pp: int, stage: int) -> tuple[tuple[str, int, bool], ...]:
    """The tensors of one pipeline stage (as `shape.tensors()` lists them) when blocks are split evenly
    (embedding with the first stage, norm and head with the last, a tied embedding on both)."""
    per = [shape.layers // pp + (s < shape.layers % pp) for s in range(pp)]
    first = sum(per[:stage])
    tensors, block = [], 0
    for t in shape.tensors():
        where = t[0]
        if where == "embed" and (stage == 0 or (shape.tied and stage == pp - 1)):
            tensors.append(t)
        elif where in ("block", "expert"):
            layer = block // shape.tensors_per_block
            block += 1
            if first <= layer < first + per[stage]:
                tensors.append(t)
        elif where == "head" and stage == pp - 1:
            tensors.append(t)
    return tuple(tensors)


def shard_groups(
    shape: ModelShape, dp: int, tp: int = 1, pp: int = 1, ep: int = 1, pipeline_stage: int = 0
) -> list[tuple[list[int], int]]:
    """(element counts of the tensors a rank trains, the ranks ZeRO shards them over) for each of its
    shard groups: the dense tensors over `dp`; under expert parallelism the rank's experts over dp/ep."""
    if ep > 1 and (dp % ep or shape.experts % ep or tp * pp > 1):
        raise ValueError(
            f"expert parallelism over {ep} ranks needs a mixture whose experts ({shape.experts}) and data-parallel "
            f"size ({dp}) it divides, without tensor ({tp}) or pipeline ({pp}) parallelism; choose another ep"
        )
    dense, experts = [], []
    for where, n, split in stage_tensors(shape, pp, pipeline_stage):
        if where == "expert" and ep > 1:
            experts.append(n // ep)
        else:
            dense.append(-(-n // tp) if split else n)
    return [(dense, dp)] + ([(experts, dp // ep)] if experts else [])


def model_state_bytes(
    shape: ModelShape,
    *,
    dp: int = 1,
    tp: int = 1,
    pp: int = 1,
    stage: int = 0,
    dtype: str = "fp32",
    offload_optimizer: bool = False,
    offload_param: bool = False,
    persistence_threshold: int = 100_000,
    pipeline_stage: int | None = None,
    ep: int = 1,
) -> dict[str, int]:
    """Bytes of params, grads, master_weights and optimizer states on one rank (the keys of
    engine.memory_report()), plus "host" for offloaded states. `pipeline_stage`: which stage (the
    largest one when None); `ep`: expert-parallel ranks (a mixture's experts split over them)."""
    stages = [pipeline_stage] if pipeline_stage is not None else range(pp)
    kw = dict(
        stage=stage,
        dtype=dtype,
        offload_optimizer=offload_optimizer,
        offload_param=offload_param,
        persistence_threshold=persistence_threshold,
    )
    reports = []
    for s in stages:
        report: dict[str, int] = {}
        for tensors, size in shard_groups(shape, dp, tp, pp, ep, s):  # summed over groups, as the engine's
            for key, value in rank_state_bytes(tensors, dp=size, **kw).items():
                report[key] = report.get(key, 0) + value
        reports.append(report)
    return max(reports, key=lambda r: r["total"])


def rank_state_bytes(
    tensors: list[int],
    *,
    dp: int = 1,
    stage: int = 0,
    dtype: str = "fp32",
    offload_optimizer: bool = False,
    offload_param: bool = False,
    persistence_threshold: int = 100_000,
) -> dict[str, int]:
    """The same for one rank from the element counts of the parameter tensors it trains (after
    tensor and pipeline parallelism): what the engine predicts for its own model at start-up."""
    if stage not in (0, 1, 2, 3):
        raise ValueError("ZeRO stage must be 0, 1, 2 or 3")
    b = 4 if dtype == "fp32" else 2
    psi = sum(tensors)
    small = sum(n for n in tensors if n < persistence_threshold) if stage == 3 else 0
    shard = math.ceil(psi / dp)
    # Stage 3 keeps a partitioned shard in the model dtype only where it is the master (fp32) or
    # offload needs it; otherwise each gather casts the fp32 master (zero/stage3.py)
    partitioned = math.ceil((psi - small) / dp) if (dtype == "fp32" or offload_optimizer or offload_param) else 0
    out = {"params": b * (psi if stage < 3 else partitioned + small)}
    out["grads"] = b * (psi if stage < 2 else shard)
    separate = dtype != "fp32"
    if stage == 0:
        out["master_weights"] = 4 * psi if separate else 0
        out["grads"] += 4 * psi if separate else 0
        out["optimizer"] = 8 * psi
    else:
        out["master_weights"] = 4 * shard if (separate or offload_optimizer) else 0
        out["optimizer"] = 8 * shard
    host = 0
    if offload_optimizer and stage > 0:
        # masters, the staging buffer the gradients arrive in (model dtype), Adam; CPU Adam reads
        # the gradients there, so only fp32 training has an fp32 gradient buffer on the host
        fp32_grads = 4 * shard if dtype == "fp32" else 0
        out["grads"] += fp32_grads
        host += 4 * shard + fp32_grads + b * shard + out["optimizer"]
    if offload_param and stage == 3:
        host += b * math.ceil((psi - small) / dp)
    out["total"] = sum(out.values())
    if host:
        out["host"] = host
    return out


def estimate_table(
    shape: ModelShape,
    dp: int,
    tp: int,
    pp: int,
    dtype: str,
    offload_optimizer: bool = False,
    offload_param: bool = False,
    persistence_threshold: int = 100_000,
    ep: int = 1,
) -> str:
    """Model-state memory per rank for each ZeRO stage, as text (`zerotron estimate`)."""
    gib = 2**30
    experts = f" ({shape.active_parameters / 1e6:,.1f}M active per token)" if shape.experts else ""
    lines = [
        f"{shape.parameters / 1e6:,.1f}M parameters{experts}, dp {dp}{f' (experts over ep {ep})' if ep > 1 else ''}"
        f" x tp {tp} x pp {pp}, {dtype}"
        f"{', optimizer offload' if offload_optimizer else ''}{', parameter offload' if offload_param else ''}",
        f"{'ZeRO':>4}  {'params':>9}  {'grads':>9}  {'masters':>9}  {'optimizer':>9}  {'device GiB':>10}  "
        f"{'host GiB':>8}",
    ]
    for stage in range(4):
        r = model_state_bytes(
            shape,
            dp=dp,
            tp=tp,
            pp=pp,
            stage=stage,
            dtype=dtype,
            offload_optimizer=offload_optimizer and stage > 0,
            offload_param=offload_param and stage == 3,
            persistence_threshold=persistence_threshold,
            ep=ep,
        )
        device = r["total"] - r.get("host", 0)
        lines.append(
            f"{stage:>4}  {r['params'] / gib:>9.2f}  {r['grads'] / gib:>9.2f}  {r['master_weights'] / gib:>9.2f}"
            f"  {r['optimizer'] / gib:>9.2f}  {device / gib:>10.2f}  {r.get('host', 0) / gib:>8.2f}"
        )
    lines.append(
        "per rank, largest pipeline stage; model states only (--seq adds activations; `zerotron plan` costs everything)"
    )
    if dtype != "fp32":
        b = 2
        lines.append(
            f"ZeRO 0 grads: the model's {dtype} gradients ({b} B/param) and the fp32 gradients of the fp32 "
            f"masters they are copied into for the step (4 B/param)"
        )
        if not (offload_optimizer or offload_param):
            lines.append(
                f"ZeRO 3 params: only those under the persistence threshold ({persistence_threshold:,} "
                f"elements) stay whole; the others have no {dtype} shard: each gather casts the fp32 "
                f"master shard (under masters)"
            )
    return "\n".join(lines)
