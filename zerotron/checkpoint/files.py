"""Checkpoint files: names, checksums, the metadata file, and a streaming safetensors writer."""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

import torch

from ..errors import ZerotronError

FORMAT = "zerotron-checkpoint"
VERSION = 1
META = "meta.json"
LATEST = "latest"


class CheckpointError(ZerotronError, RuntimeError):
    """A checkpoint that cannot be loaded as asked: the message names the file and the problem."""


def rank_file(rank: int) -> str:
    return f"rank{rank:05d}.safetensors"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def fsync_dir(path: Path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: Path, text: str):
    """Write a small text file so that readers see the old or the new content, never a mix."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_meta(directory: Path) -> dict:
    path = directory / META
    if not path.exists():
        raise CheckpointError(
            f"{path} is missing: {directory} is not a complete zerotron checkpoint "
            "(a save that did not finish leaves no such directory; check the path or tag)"
        )
    try:
        meta = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON ({e}): the checkpoint is damaged") from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a zerotron checkpoint (format {meta.get('format')!r})")
    if meta.get("version", 0) > VERSION:
        raise CheckpointError(f"{path} was written by a newer zerotron (format version {meta['version']}); upgrade")
    return meta


def verify(directory: Path, meta: dict, name: str) -> Path:
    """The path of file `name`, after checking it exists and its checksum matches."""
    path = directory / name
    if name not in meta["files"]:
        raise CheckpointError(f"{path} is not listed in {directory / META}")
    if not path.exists():
        raise CheckpointError(f"{path} is missing: the checkpoint is incomplete")
    if sha256(path) != meta["files"][name]:
        raise CheckpointError(
            f"{path} is corrupted or truncated (its SHA-256 does not match {META}); "
            "restore it or load another checkpoint"
        )
    return path


_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


class StreamingSafetensors:
    """Write a safetensors file one tensor at a time: the header (names, dtypes, shapes, offsets)
    is known up front, so memory stays at one tensor instead of the whole model."""

    def __init__(self, path: Path, entries: list[tuple[str, torch.dtype, tuple]], metadata: dict | None = None):
        header, offset = {}, 0
        for name, dtype, shape in entries:
            n = 1
            for d in shape:
                n *= d
            size = n * torch.empty((), dtype=dtype).element_size()
            header[name] = {"dtype": _DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
            offset += size
        if metadata:
            header["__metadata__"] = metadata
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
        self.expected = [(name, dtype, tuple(shape)) for name, dtype, shape in entries]
        self.file = open(path, "wb")
        self.file.write(struct.pack("<Q", len(raw)) + raw)
        self.written = 0

    def write(self, name: str, tensor: torch.Tensor):
        want = self.expected[self.written]
        if (name, tensor.dtype, tuple(tensor.shape)) != want:
            raise ValueError(
                f"tensor {name} {tensor.dtype} {tuple(tensor.shape)} written out of order; expected {want}"
            )
        self.file.write(tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
        self.written += 1

    def close(self):
        if self.written != len(self.expected):
            raise ValueError(f"only {self.written} of {len(self.expected)} tensors were written")
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
