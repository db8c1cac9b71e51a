"""Hugging Face checkpoint directories in and out of a running engine.

load_hf_weights: every rank reads, from the directory's safetensors files, only the slices of the
parameters it holds (its tensor-parallel cut, and within it the rows covering its ZeRO range), so
a ZeRO-3 / tensor-parallel model never exists whole on any rank.

save_hf_pretrained: config.json (+ generation_config.json) and the weights in the model dtype as
model.safetensors, or shards of at most `max_shard_size` bytes with model.safetensors.index.json,
loadable by `AutoModelForCausalLM.from_pretrained`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from ..checkpoint.layout import rank_pieces, stride_of, tensor_parallel_of
from ..comm import comm_for
from ..tensor_parallel.split import local_part


def _weight_files(directory: Path) -> dict[str, Path]:
    """Parameter name -> the safetensors file holding it."""
    index = directory / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: directory / file for name, file in weight_map.items()}
    single = directory / "model.safetensors"
    if not single.exists():
        raise FileNotFoundError(
            f"{directory} has neither model.safetensors nor model.safetensors.index.json "
            "(only safetensors checkpoints are read; convert .bin files first)"
        )
    with safe_open(str(single), framework="pt") as f:
        return {name: single for name in f.keys()}


def _read_piece(handle, name: str, param, lo: int, hi: int) -> torch.Tensor:
    """Elements [lo, hi) of this rank's tensor-parallel cut of `name`, reading only the rows they span."""
    dim, rank, size = tensor_parallel_of(param)
    view = handle.get_slice(name)
    if stride_of(param) > 1:  # a fused projection's cut is several blocks: read the whole tensor
        return local_part(view[:], dim, rank, size, stride_of(param)).reshape(-1)[lo:hi]
    shape = list(view.get_shape())
    cut = [slice(None)] * len(shape)
    if dim >= 0:
        step = shape[dim] // size
        cut[dim] = slice(rank * step, (rank + 1) * step)
        shape[dim] = step
    if not shape:  # a scalar
        return view[:].reshape(-1)[lo:hi]
    row = 1
    for n in shape[1:]:
        row *= n
    first, last = lo // row, -(-hi // row)  # the rows of the cut that [lo, hi) touches
    start0 = cut[0].start or 0 if isinstance(cut[0], slice) else 0
    cut[0] = slice(start0 + first, start0 + last)
    rows = view[tuple(cut)]
    return rows.reshape(-1)[lo - first * row : hi - first * row]


@torch.no_grad()
def load_hf_weights(engine, directory) -> None:
    """Load a local Hugging Face checkpoint into the engine's model (every rank must call it)."""
    directory = Path(directory)
    files = _weight_files(directory)
    handles = {}

    def handle(path):
        if path not in handles:
            handles[path] = safe_open(str(path), framework="pt")
        return handles[path]

    for piece, param, master, offset in rank_pieces(engine):
        if piece.name not in files:
            raise KeyError(f"{directory} has no tensor {piece.name!r}: it is a checkpoint of a different model")
        values = _read_piece(handle(files[piece.name]), piece.name, param, piece.lo, piece.hi)
        master.reshape(-1)[offset : offset + piece.hi - piece.lo].copy_(values)
    for name, p in engine.module.named_parameters():
        if not p.requires_grad and name in files:  # frozen parameters: whole (their tensor-parallel cut)
            p.copy_(_read_piece(handle(files[name]), name, p, 0, p.numel()).view_as(p))
    engine.states.publish(from_masters=True)


def save_hf_pretrained(engine, directory, max_shard_size: int = 5 * 2**30) -> Path:
    """Write the model as a Hugging Face directory (every rank must call it; rank 0 writes)."""
    from safetensors.torch import save_file

    from ..zero import consolidated_state_dict

    model = engine.module
    state = consolidated_state_dict(model)
    directory = Path(directory)
    if engine.global_rank == 0:
        directory.mkdir(parents=True, exist_ok=True)
        model.config.save_pretrained(directory)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(directory)
        unique, seen = {}, set()
        for name, p in model.named_parameters():  # tied weights once, under the first name (as HF saves)
            if id(p) not in seen:
                seen.add(id(p))
                unique[name] = state[name].contiguous()
        for name, _ in model.named_buffers():
            if name in state and name not in getattr(model, "_non_persistent_buffers_set", set()):
                unique.setdefault(name, state[name].contiguous())
        shards, current, size = [], {}, 0
        for name, t in unique.items():
            nbytes = t.numel() * t.element_size()
            if current and size + nbytes > max_shard_size:
                shards.append(current)
                current, size = {}, 0
            current[name] = t
            size += nbytes
        shards.append(current)
        if len(shards) == 1:
            save_file(shards[0], str(directory / "model.safetensors"), metadata={"format": "pt"})
        else:
            weight_map = {}
            for i, shard in enumerate(shards, 1):
                file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, str(directory / file), metadata={"format": "pt"})
                weight_map.update({name: file for name in shard})
            total = sum(t.numel() * t.element_size() for t in unique.values())
            (directory / "model.safetensors.index.json").write_text(
                json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
            )
    comm_for(None, "world").barrier()
    return directory
