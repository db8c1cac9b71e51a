"""`zerotron convert --from-deepspeed`: a checkpoint DeepSpeed wrote, as a zerotron checkpoint.

One rank file holds every parameter whole (the pieces of a world of one), its fp32 master and optimizer
states, with DeepSpeed's counters, scheduler, loss scaler and client state in meta.json; zerotron then
resumes it under any topology as it resumes its own (load.py). Written one tensor at a time, atomically
(save.publish). The client state keeps what JSON holds; anything else is named in a warning and left out.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from ..log import logger
from .deepspeed_in import DeepSpeedPieces
from .deepspeed_layout import DEEPSPEED_KEYS
from .files import FORMAT, VERSION, StreamingSafetensors, rank_file, sha256
from .layout import Piece
from .load import checkpoint_directory, open_checkpoint
from .save import publish


def from_deepspeed(checkpoint, out) -> Path:
    """CHECKPOINT: DeepSpeed's save_dir (with `latest`) or one of its tag directories. Writes OUT/<tag>
    and OUT/latest; returns OUT/<tag>."""
    directory = checkpoint_directory(checkpoint)
    saved = open_checkpoint(directory)
    if not isinstance(saved, DeepSpeedPieces):
        raise ValueError(f"{directory} is a zerotron checkpoint already; --from-deepspeed reads DeepSpeed's")
    meta = saved.meta
    root, tag = Path(out), meta["tag"]
    partial = root / f".{tag}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)

    pieces, entries, reads = {}, [], []
    for name in saved.names():
        shape = saved.shape(name)
        piece = Piece(name, shape, -1, 0, 1, 0, _numel(shape))
        key = f"{name}@0:0"
        pieces[key] = piece.to_json()
        for kind in ["master"] + [f"state.{k}" for k in saved.state_keys(name)]:
            entries.append((f"{kind}/{key}", torch.float32, (piece.hi,)))
            reads.append(lambda name=name, kind=kind: saved.full(name, kind).reshape(-1))
    for prefix, tensors in (("frozen", saved.frozen()), ("buffer", saved.buffers())):
        for name, t in tensors.items():
            entries.append((f"{prefix}/{name}" + ("@0" if prefix == "frozen" else ""), t.dtype, tuple(t.shape)))
            reads.append(lambda t=t: t.contiguous())
    rank_state = {"pieces": pieces, "scalars": saved.scalars}
    path = partial / rank_file(0)
    writer = StreamingSafetensors(path, entries, metadata={"zerotron": json.dumps(rank_state)})
    for (name, _, _), read in zip(entries, reads):
        writer.write(name, read())
    writer.close()
    zerotron_meta = {
        **meta,
        "format": FORMAT,
        "version": VERSION,
        "world_size": 1,
        "topology": {"dp": 1, "sp": 1, "cp": 1, "tp": 1, "pp": 1},
        "optimizer_groups": [_jsonable(g) for g in meta["optimizer_groups"]],
        "client_state": _client_state(meta["client_state"]),
        "files": {path.name: sha256(path)},
        "param_order": saved.names(),
    }
    publish(root, tag, zerotron_meta)
    return root / tag


def _client_state(state: dict) -> dict:
    kept, left = {}, []
    for key, value in state.items():
        if key in DEEPSPEED_KEYS:
            continue
        try:
            json.dumps(value)
            kept[key] = value
        except TypeError:
            left.append(key)
    if left:
        logger.warning(
            f"client state {left} left out of the zerotron checkpoint: not JSON (zerotron stores no pickles)"
        )
    return kept


def _jsonable(group: dict) -> dict:
    return {k: v.item() if torch.is_tensor(v) else list(v) if isinstance(v, tuple) else v for k, v in group.items()}


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
