"""Consolidated weights: `zerotron convert CHECKPOINT OUT` and engine.save_16bit_model.

convert reads a checkpoint written under any topology and writes one safetensors file of full
tensors, assembling and writing one parameter at a time, so memory stays near the largest tensor.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..comm import comm_for
from ..log import logger
from ..moe.expert_groups import gather_experts
from ..zero import consolidated_state_dict
from .files import StreamingSafetensors
from .load import checkpoint_directory, open_checkpoint

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def convert(checkpoint, out, dtype: str = "fp32", max_shard_size: int = 5 * 2**30) -> Path:
    """CHECKPOINT: a checkpoint directory (save_dir/tag) or a save_dir with a `latest` file.
    OUT: a directory; writes OUT/model.safetensors, or, past `max_shard_size` bytes, shards
    model-0000i-of-0000n.safetensors with model.safetensors.index.json (Hugging Face's layout); for a
    model that came from Transformers also config.json, so `from_pretrained(OUT)` loads it."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: use one of {', '.join(DTYPES)}")
    directory = checkpoint_directory(checkpoint)
    saved = open_checkpoint(directory)  # zerotron's layout or DeepSpeed's
    meta = saved.meta
    names = sorted(saved.names())
    target = DTYPES[dtype]
    entries = [(n, target, saved.shape(n)) for n in names]
    whole = {k: v for k, v in {**saved.frozen(), **saved.buffers()}.items() if k not in names}
    extra = [(k, target if t.is_floating_point() else t.dtype, tuple(t.shape)) for k, t in whole.items()]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    shards, size = [[]], 0
    for entry in entries + extra:
        nbytes = torch.empty((), dtype=entry[1]).element_size() * _numel(entry[2])
        if shards[-1] and size + nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += nbytes
    files = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    )
    for file, shard in zip(files, shards):
        writer = StreamingSafetensors(
            out / file, shard, metadata={"format": "pt", "zerotron_tag": meta["tag"], "zerotron_dtype": dtype}
        )
        for name, dt, _ in shard:  # one full tensor in memory at a time
            writer.write(name, whole[name].to(dt) if name in whole else saved.full(name, "master").to(target))
        writer.close()
    if len(files) > 1:
        total = sum(torch.empty((), dtype=e[1]).element_size() * _numel(e[2]) for e in entries + extra)
        weight_map = {e[0]: file for file, shard in zip(files, shards) for e in shard}
        (out / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
        )
    if meta.get("hf_config"):
        hf = dict(meta["hf_config"])
        hf["torch_dtype" if "dtype" not in hf else "dtype"] = {
            "fp32": "float32",
            "bf16": "bfloat16",
            "fp16": "float16",
        }[dtype]
        (out / "config.json").write_text(json.dumps(hf, indent=2))
    path = out / files[0] if len(files) == 1 else out / "model.safetensors.index.json"
    (out / "zerotron_source.json").write_text(
        json.dumps(
            {"checkpoint": str(directory), "tag": meta["tag"], "topology": meta["topology"], "dtype": dtype}, indent=1
        )
    )
    return path


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def whole_state_dict(engine, exclude_frozen: bool = False) -> dict[str, torch.Tensor]:
    """The whole model's state dict in host memory on global rank 0 (empty elsewhere; every rank must
    call it): ZeRO-3 units gathered one at a time, tensor-parallel slices joined, every expert-parallel
    rank's experts under their global numbers, and rank 0 collecting every pipeline stage's layers."""
    state = consolidated_state_dict(engine.module)
    if exclude_frozen:
        frozen = {n for n, p in engine.module.named_parameters() if not p.requires_grad}
        state = {k: v for k, v in state.items() if k not in frozen}
    state = gather_experts(state, engine.module, engine.topology)
    if engine.topology.pp > 1:  # each stage holds its own layers (in host memory): collect them on rank 0
        if engine.dp_comm.rank == 0 and engine.coords.tp == 0:
            parts = comm_for(engine.topology.group("pp"), "pp").gather_object(state)
            if engine.global_rank == 0:
                state = {k: v for part in parts for k, v in part.items()}
    return state if engine.global_rank == 0 else {}


def save_16bit_model(engine, save_dir, save_filename: str = "model.safetensors") -> bool:
    """Rank 0 writes the full model in the model dtype (every rank must call it). Under ZeRO-3 only
    with stage3_gather_16bit_weights_on_model_save, as in DeepSpeed."""
    from safetensors.torch import save_file

    zero = engine.config.zero_optimization
    if zero.stage == 3 and not zero.stage3_gather_16bit_weights_on_model_save:
        logger.warning(
            "save_16bit_model under ZeRO-3 needs zero_optimization.stage3_gather_16bit_weights_on_model_save"
            " true (it gathers every parameter); nothing saved"
        )
        return False
    state = whole_state_dict(engine)
    if engine.global_rank == 0:
        Path(save_dir).mkdir(parents=True, exist_ok=True)
        unique, seen = {}, set()
        for k, v in state.items():  # tied weights once (safetensors refuses shared memory)
            if v.untyped_storage().data_ptr() not in seen:
                seen.add(v.untyped_storage().data_ptr())
                unique[k] = v.contiguous()
        save_file(unique, str(Path(save_dir) / save_filename), metadata={"format": "pt"})
    comm_for(None, "world").barrier()
    return True
