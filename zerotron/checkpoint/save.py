"""engine.save_checkpoint: every rank writes its own pieces, in parallel, atomically.

Layout of `save_dir/tag/`:
    meta.json               topology, counters, scheduler / loss-scaler / optimizer settings,
                            client_state, and the SHA-256 of every other file (written last)
    rankNNNNN.safetensors   one per rank: its pieces of the fp32 masters ("master/…") and of each
                            optimizer state ("state.exp_avg/…"), frozen parameters and buffers
                            ("frozen/…", "buffer/…"), its RNG state ("rng/…"); the safetensors
                            metadata says what each piece is (layout.Piece)

Model weights are not stored separately: they are the masters in the model dtype (what every
optimizer step publishes), so loading them from the masters is exact.

Atomicity: everything goes to `save_dir/.tag.partial/`, which rank 0 renames to `save_dir/tag/`
only after every rank has written and checksummed its file; `latest` is replaced last. A crash at
any point leaves the previous checkpoint and `latest` as they were.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from ..comm import comm_for
from .files import FORMAT, LATEST, META, VERSION, fsync_dir, rank_file, sha256, write_atomically
from .layout import rank_pieces, tensor_parallel_of


def save_checkpoint(engine, save_dir, tag=None, client_state=None, save_latest: bool = True) -> bool:
    tag = str(tag if tag is not None else f"global_step{engine.global_steps}")
    if not tag or "/" in tag or tag.startswith("."):
        raise ValueError(f"checkpoint tag {tag!r} must be a plain directory name (no '/', not starting with '.')")
    client_state = client_state or {}
    try:
        json.dumps(client_state)
    except TypeError as e:
        raise TypeError(f"client_state must be JSON-serialisable (zerotron stores no pickles): {e}") from None
    root = Path(save_dir)
    partial = root / f".{tag}.partial"
    rank = dist.get_rank()
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)  # left by an earlier crash
        partial.mkdir()
    comm_for(None, "world").barrier()

    tensors, pieces, scalars = _rank_tensors(engine)
    rank_state = {"python_random": _jsonable(random.getstate()), "pieces": pieces, "scalars": scalars}
    path = partial / rank_file(rank)
    save_file(tensors, str(path), metadata={"zerotron": json.dumps(rank_state)})
    with open(path, "rb") as f:  # on disk before the directory can become the checkpoint
        os.fsync(f.fileno())
    gathered = comm_for(None, "world").all_gather_object((path.name, sha256(path), _module_positions(engine)))
    digests = [(name, digest) for name, digest, _ in gathered]

    if rank == 0:
        meta = {
            "format": FORMAT,
            "version": VERSION,
            "tag": tag,
            "world_size": dist.get_world_size(),
            **engine.training_state(),
            "client_state": client_state,
            "files": dict(digests),
            # The model's parameter order (ZeRO's flat buffers hold them in another): DeepSpeed's layout
            # needs it (deepspeed_out.py).
            "param_order": list(dict.fromkeys(name for _, name in sorted(p for *_, ps in gathered for p in ps))),
        }
        publish(root, tag, meta, save_latest)
    comm_for(None, "world").barrier()
    return True


def publish(root: Path, tag: str, meta: dict, save_latest: bool = True):
    """Write meta.json into root/.tag.partial (whose files are on disk), make it root/tag, then point
    `latest` at it: at every moment the old checkpoint or the new one is whole."""
    partial, final = root / f".{tag}.partial", root / tag
    (partial / META).write_text(json.dumps(meta, indent=1, default=_jsonable))
    fsync_dir(partial)
    old = root / f".{tag}.old"
    if final.exists():  # replacing a checkpoint of the same tag: keep it until the new one is in place
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
    partial.rename(final)
    shutil.rmtree(old, ignore_errors=True)
    fsync_dir(root)
    if save_latest:
        write_atomically(root / LATEST, tag)


def _module_positions(engine) -> list[tuple[tuple[int, int], str]]:
    """((pipeline stage, position in the stage's module), name) of each parameter this rank stores a piece of."""
    position = {id(p): i for i, p in enumerate(engine.module.parameters())}
    stage = engine.topology.coords(dist.get_rank()).pp
    return [((stage, position.get(id(param), len(position))), piece.name) for piece, param, *_ in rank_pieces(engine)]


def _host(t: torch.Tensor) -> torch.Tensor:
    """A host copy, piece by piece: the device never holds a second copy of the states."""
    return t.detach().to("cpu", copy=True)


def _rank_tensors(engine):
    """This rank's tensors for its file, with a JSON description of each piece."""
    tensors, pieces, scalars = {}, {}, {}
    states = engine.states
    first_replica = engine.dp_comm.rank == 0  # of the ranks holding the same parameters (data x sequence)
    if not states.replicated or first_replica or engine.topology.ep > 1:
        for piece, param, master, offset in rank_pieces(engine):
            if states.replicated and engine.shard_groups.of(param).rank != 0:  # (an expert's first holder writes it)
                continue
            key = f"{piece.name}@{piece.tp_rank}:{piece.lo}"
            n = piece.hi - piece.lo
            pieces[key] = piece.to_json()
            tensors[f"master/{key}"] = _host(master.detach().reshape(-1)[offset : offset + n]).float()
            for name, value in engine.optimizer.state.get(master, {}).items():
                if torch.is_tensor(value) and value.numel() == master.numel():
                    tensors[f"state.{name}/{key}"] = _host(value.reshape(-1)[offset : offset + n])
                else:  # per-tensor scalars (Adam's step): equal for every piece of one optimizer
                    scalars[name] = value.item() if torch.is_tensor(value) else value
        if first_replica:
            for name, p in engine.module.named_parameters():
                # (frozen parameters in ZeRO-3's partitioned units are in the master pieces already)
                if not p.requires_grad and not hasattr(p, "zt_unit"):
                    dim, r, _ = tensor_parallel_of(p)
                    tensors[f"frozen/{name}@{r}"] = _host(p)
            for name, b in engine.module.named_buffers():
                tensors[f"buffer/{name}"] = _host(b)
    tensors["rng/torch"] = torch.get_rng_state()
    if torch.cuda.is_available():
        tensors["rng/cuda"] = torch.cuda.get_rng_state()
    return tensors, pieces, scalars


def _jsonable(value):
    if isinstance(value, tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    if torch.is_tensor(value):
        return value.tolist()
    return value
