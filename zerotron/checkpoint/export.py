"""Consolidated weights: `zerotron convert CHECKPOINT OUT` and engine.save_16bit_model.

convert reads a checkpoint written under any topology and writes one safetensors file of full
tensors, assembling and writing one parameter at a time, so memory stays near the largest tensor.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist

from ..log import logger
from .files import META, StreamingSafetensors, read_meta
from .load import SavedPieces, resolve_tag

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def convert(checkpoint, out, dtype: str = "fp32") -> Path:
    """CHECKPOINT: a checkpoint directory (save_dir/tag) or a save_dir with a `latest` file.
    OUT: a directory; writes OUT/model.safetensors (with the dtype and source tag in its metadata)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    directory = Path(checkpoint)
    if not (directory / META).exists():
        tag = resolve_tag(directory, None)
        if tag is None:
            raise FileNotFoundError(f"{directory} is neither a checkpoint (no {META}) nor a save directory with "
                                    "a 'latest' file")
        directory = directory / tag
    meta = read_meta(directory)
    saved = SavedPieces(directory, meta)
    names = sorted(saved.by_name)
    frozen = sorted({key for file in saved.rank_states for key in saved._open(file).keys()
                     if key.startswith(("frozen/", "buffer/"))})
    target = DTYPES[dtype]
    entries = [(n, target, tuple(saved.by_name[n][0][2].shape)) for n in names]
    extra = []
    for key in frozen:
        t = saved.find(key)
        name = key.split("/", 1)[1].split("@")[0]
        if name not in {e[0] for e in extra} and name not in names:
            extra.append((name, t.dtype if not t.is_floating_point() else target, tuple(t.shape)))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "model.safetensors"
    writer = StreamingSafetensors(path, entries + extra, metadata={
        "format": "pt", "zerotron_tag": meta["tag"], "zerotron_dtype": dtype})
    for name, _, _ in entries:
        writer.write(name, saved.full(name, "master").to(target))
    for name, dt, _ in extra:
        key = next(k for k in frozen if k.split("/", 1)[1].split("@")[0] == name)
        writer.write(name, saved.find(key).to(dt))
    writer.close()
    (out / "zerotron_source.json").write_text(json.dumps({"checkpoint": str(directory), "tag": meta["tag"],
                                                          "topology": meta["topology"], "dtype": dtype}, indent=1))
    return path


def save_16bit_model(engine, save_dir, save_filename: str = "model.safetensors") -> bool:
    """Rank 0 writes the full model in the model dtype (every rank must call it). Under ZeRO-3 only
    with stage3_gather_16bit_weights_on_model_save, as in DeepSpeed."""
    from safetensors.torch import save_file

    from ..zero import consolidated_state_dict
    zero = engine.config.zero_optimization
    if zero.stage == 3 and not (zero.stage3_gather_16bit_weights_on_model_save or
                                zero.stage3_gather_fp16_weights_on_model_save):
        logger.warning("save_16bit_model under ZeRO-3 needs zero_optimization.stage3_gather_16bit_weights_on_model_save"
                       " true (it gathers every parameter); nothing saved")
        return False
    state = consolidated_state_dict(engine.module)
    if engine.topology.pp > 1:  # each stage holds its own layers: collect them on rank 0
        parts = [None] * engine.topology.pp if engine.global_rank == 0 else None
        first_of_stage = engine.coords.dp == 0 and engine.coords.tp == 0
        group = engine.topology.group("pp")
        if engine.coords.dp == 0 and engine.coords.tp == 0:
            dist.gather_object(state if first_of_stage else None, parts, dst=0, group=group)
        if engine.global_rank == 0:
            state = {k: v for part in parts for k, v in part.items()}
    if engine.global_rank == 0:
        Path(save_dir).mkdir(parents=True, exist_ok=True)
        unique, seen = {}, set()
        for k, v in state.items():  # tied weights once (safetensors refuses shared memory)
            if v.untyped_storage().data_ptr() not in seen:
                seen.add(v.untyped_storage().data_ptr())
                unique[k] = v.contiguous()
        save_file(unique, str(Path(save_dir) / save_filename), metadata={"format": "pt"})
    dist.barrier()
    return True
