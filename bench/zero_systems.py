"""bench/zero.py's systems: zerotron stages 0-3, torch DDP / ZeroRedundancyOptimizer, FSDP2 and DeepSpeed, each
a probed step (build_systems), and what each keeps per rank (HOLDS)."""

from __future__ import annotations

import torch

from bench import common
from bench.zero_memory import MemoryProbe
from tools import training

ADAMW = training.ADAMW


# ---- systems -------------------------------------------------------------------------------------
def zero_section(stage, args, **extra) -> dict:
    """zero_optimization for zerotron and DeepSpeed alike: the same buckets, stage-3 threshold and prefetch."""
    zero = {
        "stage": stage,
        "reduce_bucket_size": int(args.reduce_bucket_size),
        "allgather_bucket_size": int(args.reduce_bucket_size),
    }
    if stage == 3:
        zero.update(
            stage3_param_persistence_threshold=int(args.stage3_threshold),
            stage3_prefetch_bucket_size=int(args.stage3_prefetch),
            stage3_max_reuse_distance=int(args.stage3_reuse),
        )
    return {**zero, **extra}


def zerotron_system(cfg, per_rank, stage, precision, args, **zero_extra):
    zero = zero_section(stage, args, **zero_extra)
    engine, step = training.zerotron_step(
        common.build_gpt(cfg),
        per_rank,
        args.clip,
        phases=True,
        zero_optimization=zero,
        bf16={"enabled": precision == "bf16"},
    )
    probe = MemoryProbe(
        engine.module.layers,
        engine.module.parameters,
        [engine.optimizer],
        lambda: [engine],
        lambda: zerotron_hints(engine.states),
    )
    return probe.wrap(step), probe, {"config": {"zero_optimization": zero}, "engine": engine}


def zerotron_hints(states) -> dict:
    """zerotron's flat buffers by kind (stage 0 keeps them in ReplicatedStates' buckets and masters)."""
    buckets = getattr(states, "buckets", [])
    grads = [getattr(states, "master_grad_flat", None)]
    grads += [getattr(b, a, None) for b in buckets for a in ("grad_full", "grads", "grad_shard")]
    masters = [getattr(states, "master_flat", None)]
    if hasattr(states, "master"):  # stage 0
        masters += [m for m in states.master.masters if states.master.separate]
        grads += [m.grad for m in states.master.masters if states.master.separate]
    params = [getattr(b, a, None) for b in buckets for a in ("full", "shard")]
    return {"params": params, "grads": grads, "masters": masters}


def ddp_system(cfg, precision, clip, zero1: bool):
    """torch DDP (gradient_as_bucket_view=True), optionally with ZeroRedundancyOptimizer (ZeRO-1).
    bf16: torch.autocast (fp32 parameters and gradients, bf16 matmuls). DDP's own mixed precision
    (`_MixedPrecision`) records CUDA events and fails on CPU ("cpu backend doesn't support events")."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(common.build_gpt(cfg), gradient_as_bucket_view=True)
    if zero1:
        opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, fused=True, **ADAMW)
        inner = opt.optim
    else:
        opt = inner = torch.optim.AdamW(model.parameters(), fused=True, **ADAMW)
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if precision == "bf16" else None
    probe = MemoryProbe(model.module.layers, model.parameters, [inner], lambda: [model, opt])
    return probe.wrap(training.torch_step(model, opt, clip, phases=True, autocast=autocast)), probe, {}


def fsdp2_system(cfg, precision, clip, reshard: bool, mesh):
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    model = common.build_gpt(cfg)
    kw = {"mesh": mesh, "reshard_after_forward": reshard}
    if precision == "bf16":
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    for block in model.layers:
        fully_shard(block, **kw)
    fully_shard(model, **kw)
    opt = torch.optim.AdamW(model.parameters(), fused=True, **ADAMW)  # after sharding: DTensor parameters
    states = [m._get_fsdp_state() for m in model.modules() if isinstance(m, FSDPModule)]
    probe = MemoryProbe(model.layers, model.parameters, [opt], lambda: [model, opt, states])
    return probe.wrap(training.torch_step(model, opt, clip, phases=True)), probe, {}


def deepspeed_system(cfg, per_rank, stage, precision, args):
    import deepspeed

    model = common.build_gpt(cfg)
    opt = torch.optim.AdamW(model.parameters(), fused=True, **ADAMW)
    zero = zero_section(stage, args)
    config = training.zerotron_config(
        per_rank,
        args.clip,
        adamw=None,
        zero_optimization=zero,
        **({"bf16": {"enabled": True}} if precision == "bf16" else {}),
    )
    functional = torch.nn.functional
    linear = functional.linear
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    # ZeRO-3 replaces torch.nn.functional.linear, for the whole process and for good, by a Python
    # autograd function (zero_optimization.memory_efficient_linear, on by default). Keep that for
    # DeepSpeed's own steps only, so that the other systems run torch's linear.
    own_linear, functional.linear = functional.linear, linear
    inner = training.engine_step(engine, phases=True)

    def step(tokens, targets):
        functional.linear = own_linear
        try:
            return inner(tokens, targets)
        finally:
            functional.linear = linear

    probe = MemoryProbe(engine.module.layers, engine.module.parameters, [opt], lambda: [engine])
    return (
        probe.wrap(step),
        probe,
        {"config": {"zero_optimization": zero}, "optimizer_class": type(engine.optimizer).__name__},
    )


def block_numel(cfg, world) -> int:
    """Elements of one transformer block, padded to a multiple of the ranks (one zerotron unit)."""
    n = sum(p.numel() for p in common.build_gpt(cfg).layers[0].parameters())
    return -(-n // world) * world


HOLDS = {  # what each system keeps per rank (Ψ parameters, N ranks; bytes per element in front)
    "fp32": {
        "ddp": "4Ψ params, 4Ψ grads (DDP bucket views), 8Ψ AdamW",
        "zt1": "4Ψ params (flat buckets; this rank's slice is its fp32 master), 4Ψ grads (flat buckets), "
        "8Ψ/N AdamW; a 4Ψ/N copy of the gradient shard during the step",
        "torch_zero1": "4Ψ params (they are the masters), 4Ψ grads (DDP bucket views), 8Ψ/N AdamW",
        "ds1": "4Ψ params, 4Ψ/N fp32 master partition, 4Ψ/N gradient partition, 8Ψ/N AdamW, its reduce bucket",
        "zt2": "4Ψ params (own slice = master), 4Ψ/N grad shard, 8Ψ/N AdamW; bucket buffers in flight in backward",
        "fsdp2_noreshard": "4Ψ/N param shard (= master), 4Ψ/N grad shard, 8Ψ/N AdamW; 4Ψ unsharded params "
        "from forward to backward",
        "ds2": "4Ψ params, 4Ψ/N fp32 master partition, 4Ψ/N gradient partition, 8Ψ/N AdamW, its reduce bucket",
        "zt3": "4Ψ/N param shards (= masters; params under the threshold whole), 4Ψ/N grad shard, 8Ψ/N AdamW; "
        "gathered units while in use, bucket buffers in flight",
        "zt2_fsdp": "as zt2, but the full params are freed as the boundary backward reduces them and gathered "
        "after the step (own 4Ψ/N master shard), waited on in the next forward; one-block buckets",
        "zt3_fsdp": "as zt3 with every parameter partitioned and one block prefetched",
        "fsdp2_reshard": "4Ψ/N param shard (= master), 4Ψ/N grad shard, 8Ψ/N AdamW; a block unsharded while it "
        "runs (+ one prefetched), the root's params from forward to backward",
        "ds3": "4Ψ/N param partition (params under the threshold whole), 4Ψ/N fp32 masters, 4Ψ/N gradient "
        "partition, 8Ψ/N AdamW, reduce buckets, gathered params while in use",
    },
    "bf16": {
        "zt0": "2Ψ params, 2Ψ grads, 4Ψ fp32 masters, 4Ψ fp32 master grads, 8Ψ AdamW",
        "zt1": "2Ψ params, 2Ψ grads (flat buckets), 4Ψ/N fp32 master shard, 8Ψ/N AdamW; 4Ψ/N fp32 gradient "
        "shard during the step",
        "torch_zero1": "autocast: 4Ψ fp32 params (= masters), 4Ψ fp32 grads (all-reduced in fp32), 8Ψ/N AdamW; "
        "bf16 copies of the weights made per matmul",
        "ds1": "2Ψ params, 4Ψ/N fp32 master partition, 4Ψ/N fp32 gradient partition, 8Ψ/N AdamW, reduce bucket",
        "zt2": "2Ψ params, 2Ψ/N bf16 grad shard, 4Ψ/N fp32 master shard, 8Ψ/N AdamW; 4Ψ/N fp32 gradient shard "
        "during the step; bucket buffers in flight in backward",
        "fsdp2_noreshard": "4Ψ/N fp32 param shard (= master), 4Ψ/N fp32 grad shard, 8Ψ/N AdamW; 2Ψ bf16 "
        "unsharded params from forward to backward",
        "ds2": "2Ψ params, 4Ψ/N fp32 master partition, 4Ψ/N fp32 gradient partition, 8Ψ/N AdamW, reduce bucket",
        "zt3": "2Ψ/N bf16 param shards (params under the threshold whole), 2Ψ/N bf16 grad shard, 4Ψ/N fp32 "
        "masters, 8Ψ/N AdamW; gathered units while in use",
        "zt2_fsdp": "as zt2, but the bf16 params are freed as the boundary backward reduces them and gathered "
        "after the step, waited on in the next forward; one-block buckets",
        "zt3_fsdp": "as zt3 with every parameter partitioned and one block prefetched",
        "fsdp2_reshard": "4Ψ/N fp32 param shard (= master), 4Ψ/N fp32 grad shard, 8Ψ/N AdamW; bf16 blocks "
        "unsharded while in use",
        "ds3": "2Ψ/N bf16 param partition (params under the threshold whole), 4Ψ/N fp32 masters, 4Ψ/N "
        "gradient partition, 8Ψ/N AdamW, reduce buckets, gathered params while in use",
    },
}


def build_systems(precision, cfg, per_rank, world, args, use_deepspeed, mesh, wanted):
    systems, probes, infos = {}, {}, {}

    def add(name, make):
        if wanted and name not in wanted:
            return
        systems[name], probes[name], infos[name] = make()

    if precision == "fp32":
        add("ddp", lambda: ddp_system(cfg, precision, args.clip, zero1=False))
    else:
        add("zt0", lambda: zerotron_system(cfg, per_rank, 0, precision, args))
    add("zt1", lambda: zerotron_system(cfg, per_rank, 1, precision, args))
    add("torch_zero1", lambda: ddp_system(cfg, precision, args.clip, zero1=True))
    if use_deepspeed:
        add("ds1", lambda: deepspeed_system(cfg, per_rank, 1, precision, args))
    add("zt2", lambda: zerotron_system(cfg, per_rank, 2, precision, args))
    if not args.no_zt3_fsdp:
        # FSDP2 reduces and gathers one block at a time: buckets of one block
        add(
            "zt2_fsdp",
            lambda: zerotron_system(
                cfg,
                per_rank,
                2,
                precision,
                args,
                reshard_after_backward=True,
                overlap_param_gather=True,
                reduce_bucket_size=block_numel(cfg, world),
                allgather_bucket_size=block_numel(cfg, world),
            ),
        )
    add("fsdp2_noreshard", lambda: fsdp2_system(cfg, precision, args.clip, False, mesh))
    if use_deepspeed:
        add("ds2", lambda: deepspeed_system(cfg, per_rank, 2, precision, args))
    add("zt3", lambda: zerotron_system(cfg, per_rank, 3, precision, args))
    if not args.no_zt3_fsdp:
        add(
            "zt3_fsdp",
            lambda: zerotron_system(
                cfg,
                per_rank,
                3,
                precision,
                args,
                stage3_param_persistence_threshold=0,
                stage3_prefetch_bucket_size=block_numel(cfg, world),
            ),
        )
    add("fsdp2_reshard", lambda: fsdp2_system(cfg, precision, args.clip, True, mesh))
    if use_deepspeed:
        add("ds3", lambda: deepspeed_system(cfg, per_rank, 3, precision, args))
    return systems, probes, infos
