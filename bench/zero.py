"""ZeRO stages side by side: zerotron stages 1-3 vs torch ZeroRedundancyOptimizer, FSDP2 and DeepSpeed, one job.

    python bench/zero.py                      # re-executes itself under torchrun --standalone, 2 ranks
    python bench/zero.py --precision fp32 --no-deepspeed --rounds 5
    python bench/zero.py --systems zt3,fsdp2_reshard --precision bf16

Same seeded GPT, batches, fused AdamW and gradient clipping for every system; losses against a baseline of
the same precision (torch DDP in fp32, zerotron stage 0 in bf16). Pairs (PAIRS): zt1 vs torch_zero1 and ds1,
zt2 vs fsdp2_noreshard and ds2, zt3 (and zt3_fsdp, stage 3 set up as FSDP2 works) vs fsdp2_reshard and ds3.
Memory is model state as tensor bytes reachable from each system's objects, sampled around every block and
optimizer step of one untimed step (MemoryProbe); the peak is reported. Details: bench/README.md.
"""

from __future__ import annotations

import collections
import functools
import gc
import os
import sys
import time
import types
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from bench import common  # noqa: E402
from tools import reporting, training  # noqa: E402

# DeepSpeed and FSDP2 call collectives that torch 2.13 renamed; one warning per call buries the tables.
warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")

ADAMW = training.ADAMW
# zerotron system -> the peers it is compared with
PAIRS = {
    "zt1": ["torch_zero1", "ds1"],
    "zt2": ["fsdp2_noreshard", "ds2"],
    "zt2_fsdp": ["fsdp2_noreshard", "ds2"],
    "zt3": ["fsdp2_reshard", "ds3"],
    "zt3_fsdp": ["fsdp2_reshard", "ds3"],
}


def parse_args():
    p = common.base_parser(__doc__.splitlines()[0])
    p.add_argument(
        "--precision",
        choices=["fp32", "bf16", "both"],
        default="fp32",
        help="fp32, bf16 (bf16 weights and gradients, fp32 masters), or both (one sweep each). "
        "Default fp32: this CPU has no bf16 matrix unit, a bf16 step is ~10x slower",
    )
    p.add_argument("--bf16-rounds", type=int, default=5, help="rounds of the bf16 sweep (its steps take ~4 s)")
    p.add_argument("--clip", type=float, default=1.0, help="gradient clipping max norm for every system (0: off)")
    p.add_argument(
        "--reduce-bucket-size",
        type=float,
        default=1e6,
        help="zerotron's and DeepSpeed's reduce_bucket_size and allgather_bucket_size (elements). "
        "Not their 5e8 default: DeepSpeed preallocates reduce_bucket_size elements for its "
        "gradient bucket (2 GB in fp32), which would swamp the memory comparison",
    )
    p.add_argument(
        "--stage3-threshold",
        type=float,
        default=1e5,
        help="stage3_param_persistence_threshold for zt3 and ds3 (DeepSpeed's default 1e5)",
    )
    p.add_argument(
        "--stage3-reuse",
        type=float,
        default=0,
        help="stage3_max_reuse_distance for zt3 and ds3 (0: release after each forward, as FSDP2's "
        "reshard_after_forward; DeepSpeed's default 1e9 keeps small models gathered until backward)",
    )
    p.add_argument(
        "--stage3-prefetch",
        type=float,
        default=5e7,
        help="stage3_prefetch_bucket_size for zt3 and ds3 (both default to 5e7)",
    )
    p.add_argument(
        "--no-zt3-fsdp",
        action="store_true",
        help="leave out zt2_fsdp and zt3_fsdp, zerotron set up as FSDP2 works: stage 2 with "
        "reshard_after_backward and overlap_param_gather; stage 3 with threshold 0 and a one-block prefetch",
    )
    p.add_argument("--no-deepspeed", action="store_true", help="leave DeepSpeed out even when installed")
    p.add_argument("--systems", default="", help="comma-separated subset of systems to run (default: all)")
    p.add_argument(
        "--profile",
        default="",
        help="comma-separated systems to profile after the timed rounds: "
        "torch.profiler on rank 0, tables in bench/results/zero_profile_<precision>_<system>.txt",
    )
    p.add_argument("--profile-steps", type=int, default=4, help="steps per profiled system")
    return p.parse_args()


# ---- memory: tensor bytes reachable from a system's objects ---------------------------------------
_LEAVES = (
    str,
    bytes,
    int,
    float,
    complex,
    bool,
    type(None),
    type,
    types.ModuleType,
    types.BuiltinFunctionType,
    torch.device,
    torch.dtype,
    torch.Size,
)


def reachable_tensors(roots, limit: int = 2_000_000):
    """Every tensor reachable from `roots` through attributes, slots, containers, bound methods,
    partials and closures (hooks), and through tensors' .grad and attributes (DeepSpeed's ds_tensor)."""
    seen, stack, found = set(), list(roots), []
    while stack and len(seen) < limit:
        o = stack.pop()
        if id(o) in seen or isinstance(o, _LEAVES):
            continue
        seen.add(id(o))
        if torch.is_tensor(o):
            found.append(common.local_tensor(o))
            if o.is_leaf and o.grad is not None:
                stack.append(o.grad)
            stack.extend(getattr(o, "__dict__", {}).values())
            continue
        if isinstance(o, dict):
            stack.extend(o.keys())
            stack.extend(o.values())
        elif isinstance(o, (list, tuple, set, frozenset, collections.deque)):
            stack.extend(o)
        elif isinstance(o, types.MethodType):
            stack.append(o.__self__)
        elif isinstance(o, functools.partial):
            stack.extend((o.func, o.args, o.keywords))
        elif isinstance(o, types.FunctionType):
            stack.extend(c.cell_contents for c in (o.__closure__ or ()) if _cell_full(c))
        else:
            stack.extend(getattr(o, "__dict__", {}).values())
            for cls in type(o).__mro__:
                for s in getattr(cls, "__slots__", ()):
                    if isinstance(s, str) and s not in ("__dict__", "__weakref__"):
                        try:
                            stack.append(getattr(o, s))
                        except AttributeError:
                            pass
    return found


def _cell_full(cell) -> bool:
    try:
        cell.cell_contents
        return True
    except ValueError:
        return False


def state_breakdown(params, optimizers, roots, hints=None) -> dict[str, int]:
    """This rank's model-state bytes by kind; each storage counts once, in the first kind it shows up:
    params (the module's parameters as they are now: full, shards or empty), grads (of those and of the
    optimizer's tensors), optimizer (its state), masters (the optimizer's tensors when they are not the
    parameters: fp32 master shards), other (anything else the system holds: flat gradient buckets,
    gathered parameters, communication buffers). `hints` {kind: tensors} names a system's own
    buffers (zerotron's flat gradient and master buffers) so that they land in their kind, not in other."""
    seen: set[int] = set()

    def count(tensors) -> int:
        return common.tensor_bytes(tensors, seen)

    params, hints = list(params), hints or {}
    opt_params = [p for o in optimizers for g in o.param_groups for p in g["params"]]
    out = {
        "params": count(
            [p for p in params] + [getattr(p, "ds_tensor", None) for p in params] + hints.get("params", [])
        ),
        "grads": count([p.grad for p in params + opt_params if p.grad is not None] + hints.get("grads", [])),
        "optimizer": count(v for o in optimizers for s in o.state.values() for v in s.values()),
        "masters": count(opt_params + hints.get("masters", [])),
    }
    out["other"] = count(reachable_tensors(roots))
    out["total"] = sum(out.values())
    return out


class MemoryProbe:
    """Samples state_breakdown at hooks during one armed step; `peak` is the largest sample."""

    def __init__(self, blocks, params, optimizers, roots, hints=lambda: None):
        self.params, self.optimizers, self.roots, self.hints = params, optimizers, roots, hints
        self.armed, self.samples = False, []
        for i, block in enumerate(blocks):
            block.register_forward_pre_hook(lambda m, a, i=i: self.sample(f"forward block {i}"))
            block.register_forward_hook(lambda m, a, out, i=i: self._on_output(out, i))
        for opt in optimizers[:1]:
            opt.register_step_pre_hook(lambda *a: self.sample("before optimizer step"))
            opt.register_step_post_hook(lambda *a: self.sample("after optimizer step"))

    def _on_output(self, out, i):
        t = out[0] if isinstance(out, (tuple, list)) else out
        if self.armed and torch.is_tensor(t) and t.requires_grad:
            t.register_hook(lambda g: self.sample(f"backward block {i}"))

    def sample(self, where):
        if self.armed:
            breakdown = state_breakdown(self.params(), self.optimizers, self.roots(), self.hints())
            self.samples.append({"at": where, **breakdown})

    def wrap(self, step, armed_step: int = 2):
        """`step`, with the probe armed during its `armed_step`-th call (an untimed warm-up step)."""
        calls = [0]

        def wrapped(tokens, targets):
            calls[0] += 1
            self.armed = calls[0] == armed_step
            try:
                return step(tokens, targets)
            finally:
                if self.armed:
                    self.sample("after step")
                self.armed = False

        return wrapped

    @property
    def peak(self) -> dict:
        return max(self.samples, key=lambda s: s["total"]) if self.samples else {}


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


def sweep(precision, cfg, per_rank, rank, world, args, use_deepspeed, mesh, wanted, log):
    systems, probes, infos = build_systems(precision, cfg, per_rank, world, args, use_deepspeed, mesh, wanted)
    batches = common.batches_for(args, cfg, rank, world, rounds=max(args.rounds, args.bf16_rounds))
    log(f"\n== {precision}: {', '.join(systems)}")
    rounds = args.bf16_rounds if precision == "bf16" else args.rounds
    res = common.run_rounds(systems, batches, args.warmup, args.steps, rounds, log=log)

    for name in [s.strip() for s in args.profile.split(",") if s.strip()]:
        if name in systems:
            profile(name, systems[name], batches, precision, args, rank, log)

    base = "ddp" if precision == "fp32" else "zt0"
    if base not in res:
        base = next(iter(res))
    rows = common.compare(res, base, start=args.warmup)
    for name, row in rows.items():
        peak = probes[name].peak
        # the peak of either rank (they can differ by a padding element or a shard boundary)
        row.update(
            state_mb=peak.get("total", 0) / 2**20,
            state_mb_max_rank=common.max_over_ranks(peak.get("total", 0)) / 2**20,
            peak=peak,
            samples=probes[name].samples,
            holds=HOLDS[precision].get(name, ""),
        )
        info = infos[name]
        if "engine" in info:  # zerotron: the engine's own count, after the run, as a cross-check
            row["memory_report"] = info["engine"].memory_report()
        row.update({k: v for k, v in info.items() if k != "engine"})
    pairs = [
        {
            "zerotron": zt,
            "peer": peer,
            "time_ratio": res[zt]["median_ms"] / res[peer]["median_ms"],
            "time_paired": common.paired_ratio(res, zt, peer),
            "mem_ratio": rows[zt]["state_mb"] / rows[peer]["state_mb"],
        }
        for zt, peers in PAIRS.items()
        for peer in peers
        if zt in res and peer in res
    ]
    # free this sweep's models before the next one
    del systems, probes, infos
    gc.collect()
    return {"baseline": base, "rounds": rounds, "steps": args.steps, "rows": list(rows.values()), "pairs": pairs}


def profile(name, step, batches, precision, args, rank, log):
    """Run `args.profile_steps` steps of one system under torch.profiler (rank 0; the other ranks
    just run) and write its phases and its top operators by self CPU time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    ctx = torch_profile(activities=[ProfilerActivity.CPU]) if rank == 0 else None
    dist.barrier()
    if ctx is not None:
        ctx.__enter__()
    t0 = time.perf_counter()
    for i in range(args.profile_steps):
        tokens, targets = batches[i % len(batches)]
        step(tokens, targets)
    dist.barrier()
    wall = (time.perf_counter() - t0) * 1e3 / args.profile_steps
    if ctx is None:
        return
    ctx.__exit__(None, None, None)
    events = ctx.key_averages()
    phases = {e.key: e.cpu_time_total / 1e3 / args.profile_steps for e in events if e.key.startswith("phase:")}
    lines = [
        f"{name} ({precision}), rank 0, {args.profile_steps} steps, {wall:.1f} ms/step with the profiler on",
        "phases, ms/step: " + ", ".join(f"{k[6:]} {v:.1f}" for k, v in phases.items()),
        "",
        events.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60),
    ]
    path = (args.out.parent if args.out else reporting.RESULTS) / f"zero_profile_{precision}_{name}.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    log(f"profile of {name}: {lines[1]} -> {path}")


def print_sweep(precision, out, args):
    print(
        f"\n{precision}: median step ms over {out['rounds']} rounds x {out['steps']} steps; "
        f"loss vs {out['baseline']}; "
        "state = peak model-state tensor bytes per rank (rank 0)"
    )
    common.print_table(
        out["rows"],
        [
            ("system", "system", "{}"),
            ("median_ms", "median ms", "{:.1f}"),
            ("loss_diff", f"max|dloss| vs {out['baseline']}", "{:.1e}"),
            ("loss_rel_diff", "relative", "{:.1e}"),
            ("state_mb", "state MiB/rank", "{:.2f}"),
        ],
    )
    print()
    common.print_table(
        out["pairs"],
        [
            ("zerotron", "zerotron", "{}"),
            ("peer", "peer", "{}"),
            ("time_ratio", "time zt/peer", "{:.3f}"),
            ("time_paired", "paired", "{:.3f}"),
            ("mem_ratio", "memory zt/peer", "{:.3f}"),
        ],
    )
    print("\npeak model state, MiB/rank (where it peaked): params / grads / optimizer / masters / other")
    for r in out["rows"]:
        p = r["peak"]
        if p:
            print(
                f"  {r['system']:<16} {p['total'] / 2**20:7.2f} ({p['at']}): "
                + " / ".join(f"{p[k] / 2**20:.2f}" for k in ("params", "grads", "optimizer", "masters", "other"))
            )


def main():
    args = parse_args()
    rank, world, log, cfg = common.start(args)
    per_rank = args.batch // world
    wanted = {s.strip() for s in args.systems.split(",") if s.strip()}
    if args.warmup < 2:
        raise SystemExit("--warmup must be at least 2 (memory is sampled in the second, untimed, step)")
    notes = []
    use_deepspeed = common.load_deepspeed(args, notes, log) is not None
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))

    precisions = ["fp32", "bf16"] if args.precision == "both" else [args.precision]
    common.announce(
        log,
        args,
        cfg,
        f"{args.batch} sequences/step on {world} ranks, {'+'.join(precisions)}, AdamW "
        f"fused, clip {args.clip or 'off'}, reduce/allgather bucket {args.reduce_bucket_size:.0e}, stage-3 "
        f"threshold {args.stage3_threshold:.0e} prefetch {args.stage3_prefetch:.0e}",
    )
    sweeps = {}
    for precision in precisions:
        sweeps[precision] = sweep(precision, cfg, per_rank, rank, world, args, use_deepspeed, mesh, wanted, log)
    if rank == 0:
        for precision, out in sweeps.items():
            print_sweep(precision, out, args)
        print(
            "\ntime zt/peer: ratio of the medians; paired: median over rounds of the per-round ratio (prefer it). "
            "memory zt/peer: peak model-state bytes, zerotron / peer."
        )
    common.finish(
        "zero",
        args,
        {
            "model": common.model_json(args, cfg, block_numel=block_numel(cfg, world)),
            "adamw": {**ADAMW, "betas": list(ADAMW["betas"]), "fused": True},
            "pairs": PAIRS,
            "notes": notes,
            "sweeps": sweeps,
        },
        rank,
    )


if __name__ == "__main__":
    main()
