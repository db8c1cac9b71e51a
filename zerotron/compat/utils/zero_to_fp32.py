"""`deepspeed.utils.zero_to_fp32`: the full fp32 weights of a checkpoint that zerotron saved under
any topology, or that DeepSpeed saved (ZeRO 1-3, or its universal layout), in one process, without a
process group.

    from zerotron.compat.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    state_dict = get_fp32_state_dict_from_zero_checkpoint("ckpt")      # the tag in ckpt/latest
    model.load_state_dict(state_dict)

The pieces are assembled by zerotron's checkpoint reader (zerotron/checkpoint/load.py), one
parameter at a time; `lazy_mode=True` defers even that until each tensor's `.contiguous()`.
Also runnable: `python -m zerotron.compat.utils.zero_to_fp32 CHECKPOINT_DIR OUTPUT_DIR [-t TAG]`.
Weights tied to another parameter (an output head sharing the embedding) appear under each of their
names, as in DeepSpeed, so the state dict loads with strict=True (from checkpoints that record the
names; older ones give the first name only).
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import torch

from ...log import logger

_SIZE_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_FILE_SUFFIXES = (".bin", ".pt", ".pth", ".safetensors")


def _checkpoint_directory(checkpoint_dir, tag) -> Path:
    root = Path(checkpoint_dir)
    if tag is None:
        latest = root / "latest"
        if not latest.is_file():
            raise ValueError(f"no 'latest' file in {root}: pass tag= (e.g. 'global_step100')")
        tag = latest.read_text().strip()
    directory = root / str(tag)
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory} does not exist: no checkpoint with tag {tag!r} in {root}")
    return directory


class LazyTensor:
    """A tensor of the checkpoint not assembled yet: `.contiguous()` reads it (as DeepSpeed's lazy mode)."""

    def __init__(self, read, shape, dtype):
        self._read, self.shape, self.dtype = read, torch.Size(shape), dtype

    def contiguous(self) -> torch.Tensor:
        return self._read().contiguous()

    def __repr__(self):
        return f"LazyTensor(shape={tuple(self.shape)}, dtype={self.dtype})"


def _lazy_state_dict(directory: Path, exclude_frozen_parameters: bool) -> dict[str, LazyTensor]:
    from ...checkpoint.load import open_checkpoint

    saved = open_checkpoint(directory)  # zerotron's layout or DeepSpeed's
    state = {}
    for name in sorted(saved.names()):  # trainable parameters: their fp32 masters
        state[name] = LazyTensor(lambda name=name: saved.full(name, "master"), saved.shape(name), torch.float32)
    whole = {**({} if exclude_frozen_parameters else saved.frozen()), **saved.buffers()}
    for name, value in whole.items():  # frozen parameters and buffers, stored whole
        state.setdefault(name, LazyTensor(lambda value=value: value, value.shape, value.dtype))
    for alias, name in saved.aliases().items():  # DeepSpeed's shared (tied) parameters, under both names
        if name in state:
            state.setdefault(alias, state[name])
    return state


def get_fp32_state_dict_from_zero_checkpoint(
    checkpoint_dir, tag=None, exclude_frozen_parameters: bool = False, lazy_mode: bool = False
) -> dict:
    """The whole model's state dict in fp32 (buffers and frozen parameters as saved), on the CPU.
    `checkpoint_dir` holds the tag directories and `latest`; `tag` picks one (default: latest).
    With `lazy_mode` the values are LazyTensor objects: call `.contiguous()` to read each."""
    state = _lazy_state_dict(_checkpoint_directory(checkpoint_dir, tag), exclude_frozen_parameters)
    if lazy_mode:
        return state
    return _read(state, state)


def _read(state: dict, names) -> dict[str, torch.Tensor]:
    """`names`' tensors, each LazyTensor read once: tied names share one tensor object, as in DeepSpeed's state
    dict (torch.save then writes it once, and a model loading it gets the tie back)."""
    once: dict[int, torch.Tensor] = {}
    out = {}
    for name in names:
        lazy = state[name]
        if id(lazy) not in once:
            once[id(lazy)] = lazy.contiguous()
        out[name] = once[id(lazy)]
    return out


def _parse_size(size) -> int | None:
    if size is None or isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", str(size))
    if not m or m.group(2).upper() not in _SIZE_UNITS:
        raise ValueError(f"max_shard_size {size!r}: give bytes (an int) or a size like '5GB' or '500MiB'")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).upper()])


def _shards(state: dict, max_bytes: int | None) -> list[list[str]]:
    shards, size = [[]], 0
    for name, t in state.items():
        n = t.shape.numel() * torch.empty((), dtype=t.dtype).element_size()
        if max_bytes is not None and shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards


def _write(tensors: dict, path: Path, safe_serialization: bool):
    if safe_serialization:
        from safetensors.torch import save_file

        seen: set[int] = set()  # safetensors refuses tensors sharing memory: a tied weight's second name gets a copy
        tensors = {k: v.clone() if id(v) in seen else seen.add(id(v)) or v for k, v in tensors.items()}
        save_file(tensors, str(path), metadata={"format": "pt"})
    else:
        torch.save(tensors, str(path))


def convert_zero_checkpoint_to_fp32_state_dict(
    checkpoint_dir,
    output_dir,
    max_shard_size="5GB",
    safe_serialization: bool = False,
    tag=None,
    exclude_frozen_parameters: bool = False,
):
    """Write the checkpoint's fp32 state dict into `output_dir`, as DeepSpeed does:
    `pytorch_model.bin` (torch.save), or `model.safetensors` with `safe_serialization`; past
    `max_shard_size` in shards `pytorch_model-00001-of-0000N.bin` (or `model-...safetensors`) with
    a `*.index.json` weight map, Hugging Face's layout. An `output_dir` ending in .bin / .pt /
    .pth / .safetensors is taken as one output file (DeepSpeed's older `output_file` argument)."""
    directory = _checkpoint_directory(checkpoint_dir, tag)
    out = Path(output_dir)
    if out.suffix in _FILE_SUFFIXES and not out.is_dir():
        state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag, exclude_frozen_parameters)
        out.parent.mkdir(parents=True, exist_ok=True)
        _write(state, out, safe_serialization or out.suffix == ".safetensors")
        return
    max_bytes = _parse_size(max_shard_size)
    if safe_serialization and not exclude_frozen_parameters:
        # zerotron's own export streams one tensor at a time into the same files and index
        from ...checkpoint.export import convert

        convert(directory, out, dtype="fp32", max_shard_size=max_bytes if max_bytes is not None else 2**62)
        return
    state = _lazy_state_dict(directory, exclude_frozen_parameters)
    shards = _shards(state, max_bytes)
    base = "model.safetensors" if safe_serialization else "pytorch_model.bin"
    stem, ext = base.rsplit(".", 1)
    names = (
        [base]
        if len(shards) == 1
        else [f"{stem}-{i:05d}-of-{len(shards):05d}.{ext}" for i in range(1, len(shards) + 1)]
    )
    out.mkdir(parents=True, exist_ok=True)
    total = 0
    for file, shard in zip(names, shards):
        tensors = _read(state, shard)
        total += sum(t.numel() * t.element_size() for t in {id(t): t for t in tensors.values()}.values())
        _write(tensors, out / file, safe_serialization)
        del tensors
    if len(shards) > 1:
        weight_map = {name: file for file, shard in zip(names, shards) for name in shard}
        (out / f"{base}.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2, sort_keys=True) + "\n"
        )


def load_state_dict_from_zero_checkpoint(model: torch.nn.Module, checkpoint_dir, tag=None) -> torch.nn.Module:
    """Move `model` to the CPU and load the checkpoint's fp32 weights into it (strict=False, as
    DeepSpeed); returns the model. It is then a plain model again: build a new engine to train it."""
    logger.info(f"loading fp32 weights from {checkpoint_dir}")
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    model = model.cpu()
    model.load_state_dict(state, strict=False)
    return model


def main(argv=None):
    parser = argparse.ArgumentParser(description="Consolidate a zerotron checkpoint into fp32 weights.")
    parser.add_argument("checkpoint_dir", help="directory holding the tag directories and 'latest'")
    parser.add_argument("output_dir", help="directory for the fp32 state dict files")
    parser.add_argument("--max_shard_size", default="5GB", help="largest file before sharding, e.g. 5GB")
    parser.add_argument("--safe_serialization", action="store_true", help="write safetensors instead of torch.save")
    parser.add_argument("-t", "--tag", default=None, help="checkpoint tag (default: the one in 'latest')")
    parser.add_argument("--exclude_frozen_parameters", action="store_true", help="leave frozen parameters out")
    parser.add_argument("-d", "--debug", action="store_true", help="accepted for DeepSpeed's command line")
    args = parser.parse_args(argv)
    convert_zero_checkpoint_to_fp32_state_dict(
        args.checkpoint_dir,
        args.output_dir,
        args.max_shard_size,
        args.safe_serialization,
        args.tag,
        args.exclude_frozen_parameters,
    )


if __name__ == "__main__":
    main()
