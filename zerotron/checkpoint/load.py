"""engine.load_checkpoint: any topology reads a checkpoint written by any other.

Each rank lists the pieces it needs (layout.rank_pieces under its own topology and ZeRO stage),
finds the saved pieces of the same parameters in the files' metadata, assembles one full
parameter at a time from them (so memory stays near the largest parameter), and keeps its slice.
Every file it opens is checked against the SHA-256 in meta.json first.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open

from ..comm import comm_for
from ..log import logger
from .deepspeed_in import DeepSpeedPieces
from .deepspeed_layout import LATEST_UNIVERSAL, is_deepspeed
from .files import LATEST, META, CheckpointError, read_meta, verify
from .layout import Piece, assemble, my_slice, rank_pieces, tensor_parallel_of


class SavedPieces:
    """The pieces of one checkpoint directory, by parameter name, read lazily file by file."""

    def __init__(self, directory: Path, meta: dict):
        self.directory, self.meta = directory, meta
        self.by_name: dict[str, list[tuple[str, str, Piece]]] = {}
        self.scalars: dict = {}
        self.rank_states: dict[str, dict] = {}
        self._verified: set[str] = set()
        for name in sorted(meta["files"]):
            if name.endswith(".safetensors"):
                with self._open(name) as handle:
                    info = json.loads(handle.metadata()["zerotron"])
                self.rank_states[name] = info
                self.scalars.update(info["scalars"])
                for key, piece in info["pieces"].items():
                    p = Piece.from_json(piece)
                    self.by_name.setdefault(p.name, []).append((name, key, p))

    def _open(self, name: str):
        """A fresh handle (use it in a with-block): safetensors maps the whole file, and pieces read
        through a handle stay resident until it closes, so no handle outlives one parameter."""
        path = self.directory / name
        if name not in self._verified:
            verify(self.directory, self.meta, name)
            self._verified.add(name)
        try:
            return safe_open(str(path), framework="pt")
        except Exception as e:  # noqa: BLE001 - any parse failure means a damaged file
            raise CheckpointError(f"{path} cannot be read as safetensors ({e}): the file is damaged") from None

    def full(self, name: str, kind: str) -> torch.Tensor:
        """The whole parameter `name` for `kind` ("master" or "state.<key>")."""
        found = self.by_name.get(name)
        if not found:
            raise CheckpointError(
                f"{self.directory} has no parameter {name!r}: the checkpoint is from a different "
                "model (or was saved with other parameter names)"
            )
        parts = []
        for file, key, piece in found:
            with self._open(file) as handle:
                if f"{kind}/{key}" not in handle.keys():
                    raise CheckpointError(
                        f"{self.directory / file} has no {kind} for {name!r}; save with the "
                        "optimizer states, or load with load_optimizer_states=False"
                    )
                parts.append((piece, handle.get_tensor(f"{kind}/{key}").clone()))
        return assemble(parts, name)

    def names(self) -> list[str]:
        """The trainable parameters in the model's order (a checkpoint from before that was recorded: the files')."""
        return [n for n in self.meta.get("param_order", self.by_name) if n in self.by_name]

    def shape(self, name: str) -> tuple | None:
        found = self.by_name.get(name)
        return tuple(found[0][2].shape) if found else None

    def state_keys(self, name: str) -> list[str]:
        """The per-element optimizer states saved for `name` (exp_avg, exp_avg_sq, ...)."""
        file, key, _ = self.by_name[name][0]
        return sorted(
            k.split("/", 1)[0][len("state.") :]
            for k in self.keys(file)
            if k.startswith("state.") and k.endswith("/" + key)
        )

    def frozen(self) -> dict[str, torch.Tensor]:
        return self._whole("frozen")

    def buffers(self) -> dict[str, torch.Tensor]:
        return self._whole("buffer")

    def _whole(self, kind: str) -> dict[str, torch.Tensor]:
        """Tensors stored whole ("frozen/<name>@<tp rank>", "buffer/<name>"), by name, first copy of each."""
        found = {}
        for file in self.rank_states:
            for key in self.keys(file):
                if key.startswith(kind + "/"):
                    found.setdefault(key.split("/", 1)[1].split("@")[0], (file, key))
        return {name: self.tensor(file, key) for name, (file, key) in found.items()}

    def aliases(self) -> dict[str, str]:
        return dict(self.meta.get("tied") or {})  # tied weights: saved once, named by engine.training_state()

    def rng(self, rank: int):
        """(torch, cuda or None, python random) state of `rank`, or None where none was saved."""
        from .files import rank_file

        name = rank_file(rank)
        torch_state = self.tensor(name, "rng/torch") if name in self.rank_states else None
        if torch_state is None:
            return None
        return torch_state, self.tensor(name, "rng/cuda"), self.rank_states[name]["python_random"]

    def keys(self, file: str) -> list[str]:
        with self._open(file) as handle:
            return list(handle.keys())

    def tensor(self, file: str, key: str) -> torch.Tensor | None:
        with self._open(file) as handle:
            return handle.get_tensor(key).clone() if key in handle.keys() else None

    def find(self, key: str) -> torch.Tensor | None:
        for file in self.rank_states:
            t = self.tensor(file, key)
            if t is not None:
                return t
        return None


def resolve_tag(load_dir: Path, tag) -> str | None:
    if tag is not None:
        return str(tag)
    for name in (LATEST, LATEST_UNIVERSAL):  # (ds_to_universal's output names its tag in the second)
        if (load_dir / name).exists():
            return (load_dir / name).read_text().strip()
    return None


def checkpoint_directory(path) -> Path:
    """A checkpoint directory itself (save_dir/tag), or the one a save directory's `latest` names."""
    directory = Path(path)
    if (directory / META).exists() or is_deepspeed(directory):
        return directory
    if not directory.exists():
        raise FileNotFoundError(f"{directory} does not exist: pass a checkpoint directory or a save directory")
    tag = resolve_tag(directory, None)
    if tag is None:
        raise FileNotFoundError(
            f"{directory} is neither a checkpoint (no {META}) nor a save directory with a 'latest' file"
        )
    return directory / tag


def open_checkpoint(directory: Path):
    """The saved pieces of a checkpoint directory: zerotron's (meta.json) or one DeepSpeed wrote."""
    if is_deepspeed(directory):
        return DeepSpeedPieces(directory)
    return SavedPieces(directory, read_meta(directory))


@torch.no_grad()
def load_checkpoint(
    engine,
    load_dir,
    tag=None,
    load_optimizer_states: bool = True,
    load_lr_scheduler_states: bool = True,
    load_module_only: bool = False,
    *,
    load_module_strict: bool = True,
):
    root = Path(load_dir)
    tag = resolve_tag(root, tag)
    if tag is None:
        why = "does not exist" if not root.exists() else f"has no '{LATEST}' file (pass tag= to pick a checkpoint)"
        logger.warning(f"{root} {why}: nothing to load")
        return None, None
    directory = root / tag
    if not directory.is_dir():
        raise CheckpointError(f"{directory} does not exist: no checkpoint with tag {tag!r} in {root}")
    saved = open_checkpoint(directory)
    meta = saved.meta

    want_states = load_optimizer_states and not load_module_only
    for piece, param, master, offset in rank_pieces(engine):
        shape = saved.shape(piece.name)
        if shape is None:
            if load_module_strict:
                raise CheckpointError(
                    f"parameter {piece.name!r} is not in {directory}: the checkpoint is from a "
                    "different model (load_module_strict=False keeps its current value)"
                )
            continue
        if shape != tuple(piece.shape):
            raise CheckpointError(
                f"parameter {piece.name!r} has shape {shape} in {directory} but "
                f"{tuple(piece.shape)} in this model: the checkpoint is from a different model"
            )
        n = piece.hi - piece.lo
        master.reshape(-1)[offset : offset + n].copy_(my_slice(saved.full(piece.name, "master"), param, piece.lo, n))
        if want_states:
            for key in saved.state_keys(piece.name):
                value = my_slice(saved.full(piece.name, f"state.{key}"), param, piece.lo, n)
                state = engine.optimizer.state[master]
                if key not in state:
                    state[key] = torch.zeros_like(master)
                state[key].reshape(-1)[offset : offset + n].copy_(value)
    if want_states:
        _load_scalars(engine, saved.scalars)
        for group, saved_group in zip(engine.optimizer.param_groups, meta["optimizer_groups"]):
            group.update({k: tuple(v) if k == "betas" else v for k, v in saved_group.items()})
    _load_frozen_and_buffers(engine, saved)
    engine.states.publish(from_masters=True)  # model weights = masters in the model dtype

    if not load_module_only:
        engine.load_training_state(meta, load_lr_scheduler_states)
        _load_rng(saved, meta)
    comm_for(None, "world").barrier()
    return str(directory), meta["client_state"]


def _load_scalars(engine, scalars: dict):
    for master, state in engine.optimizer.state.items():
        for key, value in scalars.items():
            if key in state and torch.is_tensor(state[key]):
                state[key].fill_(value)
            else:  # torch's Adam keeps its step as an fp32 tensor next to the parameter
                state[key] = torch.tensor(value, dtype=torch.float32, device=master.device)


def _load_frozen_and_buffers(engine, saved: SavedPieces):
    for name, p in engine.module.named_parameters():
        if not p.requires_grad:
            dim, r, _ = tensor_parallel_of(p)
            value = saved.find(f"frozen/{name}@{r}")
            if value is not None:
                p.copy_(value)
    for name, b in engine.module.named_buffers():
        value = saved.find(f"buffer/{name}")
        if value is not None:
            b.copy_(value)


def _load_rng(saved, meta: dict):
    """The RNG state of this rank, when the checkpoint was written by as many ranks (exact resume)."""
    rng = saved.rng(dist.get_rank()) if meta["world_size"] == dist.get_world_size() else None
    if rng is None:
        return
    torch_state, cuda, state = rng
    torch.set_rng_state(torch_state)
    if cuda is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(cuda)
    random.setstate((state[0], tuple(state[1]), state[2]))
