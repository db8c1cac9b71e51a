"""`zerotron convert --to-deepspeed`: a checkpoint (zerotron's, or DeepSpeed's under another layout) written
as DeepSpeed's save_checkpoint writes one, for DeepSpeed's engine.load_checkpoint at a given ZeRO stage
and data-parallel size, so a run can go back to DeepSpeed.

The files, their keys and DeepSpeed's objects in them mirror what DeepSpeed 0.19.8 writes (deepspeed_in.py
reads the same keys; deepspeed_layout.py has the partition arithmetic both use). One parameter group, the
parameters in the checkpoint's order (the model's): DeepSpeed's engine must be built with the module's
parameters in that order (model.parameters(), DeepSpeed's default). Optimizer states are written as
torch's Adam keeps them (exp_avg, exp_avg_sq, step).
"""

from __future__ import annotations

import shutil
from collections import OrderedDict
from pathlib import Path

import torch

from ..log import logger
from . import deepspeed_layout as layout
from .deepspeed_pickle import FragmentAddress, LossScaler, ZeroStageEnum, save
from .files import write_atomically
from .load import checkpoint_directory, open_checkpoint

DEEPSPEED_VERSION = "0.19.8"  # the release whose layout this writes
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def to_deepspeed(checkpoint, out, stage: int | None = None, world: int | None = None, dtype: str | None = None) -> Path:
    """Write CHECKPOINT as OUT/<tag>/ and OUT/latest in DeepSpeed's layout for ZeRO `stage` on `world`
    data-parallel ranks in `dtype` (each default: the checkpoint's own). Returns OUT/<tag>."""
    saved = open_checkpoint(checkpoint_directory(checkpoint))
    meta = saved.meta
    stage = meta["zero_stage"] if stage is None else stage
    world = meta["topology"]["dp"] * meta["topology"]["tp"] if world is None else world
    dtype = dtype or meta["dtype"]
    if stage not in (0, 1, 2, 3) or world < 1 or dtype not in ("fp32", "bf16"):
        raise ValueError(
            f"ZeRO stage {stage}, world size {world}, dtype {dtype!r}: give a stage 0-3, a world size >= 1 and "
            "fp32 or bf16 (fp16 is not written: DeepSpeed's dynamic loss-scaler state would have to be made up; "
            "convert to bf16 or fp32, or resume the fp16 run in zerotron)"
        )
    names = saved.names()
    if meta["format"] != "deepspeed" and "param_order" not in meta:
        logger.warning(
            f"{checkpoint} predates zerotron recording the model's parameter order: written in the order its files "
            "hold them, which DeepSpeed's ZeRO 1-2 take as the model's; resume it in zerotron and save it again"
        )
    tag = meta["tag"]
    root = Path(out)
    target = root / tag
    shutil.rmtree(target, ignore_errors=True)
    target.mkdir(parents=True)

    state_keys = saved.state_keys(names[0]) if names else []
    flat = {
        kind: [saved.full(n, kind).reshape(-1) for n in names]
        for kind in ["master"] + [f"state.{k}" for k in state_keys]
    }
    step = torch.tensor(float(saved.scalars.get("step", meta["counters"]["global_steps"])))
    shapes = OrderedDict((n, torch.Size(saved.shape(n))) for n in names)
    group = {k: tuple(v) if k == "betas" else v for k, v in (meta["optimizer_groups"] or [{}])[0].items()}
    group = {k: v for k, v in group.items() if k not in layout.IMPLEMENTATION_KEYS}

    model_states = _model_states(saved, meta, names, flat["master"], stage, world, dtype)
    if stage == 0:
        model_states["optimizer"] = _stage0_optimizer(flat, state_keys, step, group, shapes, dtype, meta)
    else:
        model_states["param_shapes"] = [shapes]
        write = _zero3_rank if stage == 3 else _zero12_rank
        for rank in range(world):
            sd = write(flat, state_keys, step, group, names, stage, world, rank)
            common = {"ds_config": model_states["ds_config"], "ds_version": DEEPSPEED_VERSION}
            save({"optimizer_state_dict": sd, **common}, target / layout.optim_states(rank, dtype == "bf16"))
    if stage == 3:
        empty = {n: torch.empty(0, dtype=_DTYPES[dtype]) for n in names}
        model_states["module"] = OrderedDict({**model_states["module"], **empty})
        for rank in range(world):
            save(model_states, target / layout.zero3_model_states(rank))
    else:
        save(model_states, target / layout.MODEL_STATES)
    write_atomically(root / "latest", tag)
    return target


def _model_states(saved, meta, names, masters, stage, world, dtype) -> dict:
    module = OrderedDict((n, m.view(saved.shape(n)).to(_DTYPES[dtype])) for n, m in zip(names, masters))
    buffers = saved.buffers()
    frozen = {n: t for n, t in saved.frozen().items() if n not in module}
    module.update(frozen)
    module.update(buffers)
    client = {k: v for k, v in meta["client_state"].items() if k not in layout.DEEPSPEED_KEYS}
    return {
        "module": module,
        "buffer_names": list(buffers),
        "optimizer": None,
        "param_shapes": None,
        "frozen_param_shapes": OrderedDict((n, t.shape) for n, t in frozen.items()) if stage else None,
        "shared_params": {},
        "frozen_param_fragments": dict(frozen) if stage else None,
        "lr_scheduler": meta["lr_scheduler"],
        "data_sampler": None,
        "random_ltd": None,
        "skipped_steps": meta["counters"]["skipped_steps"],
        "global_steps": meta["counters"]["global_steps"],
        "global_samples": meta["counters"]["global_samples"],
        "dp_world_size": world,
        "mp_world_size": 1,
        "ds_config": {"zero_optimization": {"stage": stage}, "bf16": {"enabled": dtype == "bf16"}},
        "ds_version": DEEPSPEED_VERSION,
        **client,
    }


def _stage0_optimizer(flat, state_keys, step, group, shapes, dtype, meta) -> dict:
    n = len(shapes)
    state = {
        i: {"step": step.clone(), **{k: flat[f"state.{k}"][i].view(s).clone() for k in state_keys}}
        for i, s in enumerate(shapes.values())
    }
    torch_sd = {"state": state, "param_groups": [{**group, "params": list(range(n))}]}
    if dtype == "fp32":
        return torch_sd
    return {  # DeepSpeed's 16-bit wrapper: fp32 masters beside the torch optimizer's state
        "dynamic_loss_scale": False,
        "cur_scale": float(meta["loss_scaler"].get("scale", 1.0)),
        "cur_iter": int(meta["loss_scaler"].get("iteration", meta["counters"]["global_steps"])),
        "optimizer_state_dict": torch_sd,
        "fp32_groups": [[m.view(s).clone() for m, s in zip(flat["master"], shapes.values())]],
    }


def _zero12_rank(flat, state_keys, step, group, names, stage, world, rank) -> dict:
    offsets, total = layout.group_offsets([m.numel() for m in flat["master"]])
    padded = layout.padded_group_numel(total, world)
    size = padded // world
    lo, hi = rank * size, (rank + 1) * size
    padding = max(0, hi - total)

    def partition(kind):
        whole = torch.cat(flat[kind] + [torch.zeros(padded - total)])
        return whole[lo:hi].clone()

    mappings = OrderedDict()
    for name, offset, m in zip(names, offsets, flat["master"]):
        start, end = max(lo, offset), min(hi, offset + m.numel())
        if start < end:
            mappings[name] = FragmentAddress(numel=end - start, start=start - lo)
    state = {"step": step.clone(), **{k: partition(f"state.{k}") for k in state_keys}}
    return {
        "loss_scaler": LossScaler(cur_scale=1.0, dynamic=False),
        "dynamic_loss_scale": False,
        "overflow": False,
        "clip_grad": 0.0,
        "base_optimizer_state": {"state": {0: state}, "param_groups": [{**group, "params": [0]}]},
        "single_partition_of_fp32_groups": [partition("master")[: size - padding]],
        "zero_stage": ZeroStageEnum(stage),
        "group_paddings": [padding],
        "param_alignment_paddings": [[0] * len(names)],
        "partition_count": [world],
        "ds_version": DEEPSPEED_VERSION,
        "param_slice_mappings": [mappings],
    }


def _zero3_rank(flat, state_keys, step, group, names, stage, world, rank) -> dict:
    def pieces(kind):
        out = []
        for m in flat[kind]:
            piece = layout.zero3_piece_numel(m.numel(), world)
            padded = torch.cat([m, torch.zeros(piece * world - m.numel())])
            out.append(padded[rank * piece : (rank + 1) * piece])
        return torch.cat(out).clone()

    state = {"step": step.clone(), **{k: pieces(f"state.{k}") for k in state_keys}}
    return {
        "zero_stage": ZeroStageEnum.weights,
        "loss_scaler": LossScaler(cur_scale=1.0, dynamic=False),
        "dynamic_loss_scale": False,
        "overflow": False,
        "partition_count": world,
        "optimizer_state_dict": {"state": {0: state}, "param_groups": [{**group, "params": [0]}]},
        "fp32_flat_groups": [pieces("master")],
    }
