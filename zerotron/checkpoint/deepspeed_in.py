"""A checkpoint directory DeepSpeed wrote, presented as load.py's SavedPieces presents zerotron's: the
full fp32 master and optimizer-state tensors of each parameter by name, plus counters, scheduler, loss
scaler and client state. So load.py resumes it under any topology and ZeRO stage, and export.py and
zero_to_fp32 read it, with no code of their own for DeepSpeed.

Read (semantics from DeepSpeed's own readers, zero_to_fp32 and its universal checkpoint loader):
- ZeRO 0: `mp_rank_00_model_states.pt` alone: the module's state dict, and the optimizer's state dict
  (by parameter index, in the module's parameter order; bf16 adds per-parameter fp32 masters);
- ZeRO 1-2 (fp32, bf16): `*zero_pp_rank_R_mp_rank_00_optim_states.pt` per data-parallel rank, each with
  its flat fp32 partition per group and the optimizer's flat states; parameter names and shapes in the
  model states' `param_shapes` (layout: deepspeed_layout.py);
- ZeRO-3: the same per rank, with one `zero_pp_rank_R_mp_rank_00_model_states.pt` per rank;
- universal (ds_to_universal): `zero/<name>/fp32.pt`, `exp_avg.pt`, ... one full tensor per file.
Every file goes through deepspeed_pickle.load (no code runs). Tensor- or pipeline-parallel DeepSpeed
checkpoints are refused by name: DeepSpeed's ds_to_universal merges them into the universal layout.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..log import logger
from . import deepspeed_layout as layout
from .deepspeed_pickle import load
from .files import CheckpointError

# What DeepSpeed's own load_checkpoint keeps out of the client state it returns (everything else of
# the model-states dict is handed back, as DeepSpeed does).
_DEEPSPEED_STATES = ("module", "skipped_steps", "global_steps", "dp_world_size", "mp_world_size", "data_sampler")
_DEEPSPEED_STATES += ("random_ltd", "lr_scheduler", "optimizer")


class DeepSpeedPieces:
    def __init__(self, directory: Path):
        self.directory = Path(directory)
        d = self.directory
        if any(f.name.split("mp_rank_")[1][:2] != "00" for f in d.glob("*mp_rank_*_model_states.pt")) or any(
            d.glob("layer_*-model_states.pt")
        ):
            raise CheckpointError(
                f"{d} is a tensor- or pipeline-parallel DeepSpeed checkpoint: zerotron reads those after "
                "DeepSpeed's ds_to_universal has merged them (python -m deepspeed.checkpoint.ds_to_universal "
                f"--input_folder {d} --output_folder {d}_universal), then loads that directory"
            )
        self.zero3_files = sorted(d.glob("zero_pp_rank_*_mp_rank_00_model_states.pt"), key=layout.dp_rank_of)
        self.model = load(self.zero3_files[0] if self.zero3_files else d / layout.MODEL_STATES)
        self._buffers = {n: self.model["module"][n] for n in self.model.get("buffer_names") or []}
        optim_files = sorted(d.glob("*zero_pp_rank_*_mp_rank_00_optim_states.pt"), key=layout.dp_rank_of)
        self.optim = [load(f)["optimizer_state_dict"] for f in optim_files]
        self.loc: dict[str, tuple] = {}  # name -> (shape, where: what the layout's reader needs)
        if (d / layout.UNIVERSAL_DIR).is_dir():
            self.kind, self.stage = "universal", int(self._zero_settings().get("zero_stage", 0))
            self._index_universal()
        elif self.optim:
            self.stage = int(self.optim[0]["zero_stage"])
            self.kind = "zero3" if self.stage == 3 else "zero12"
            self._index_zero3() if self.stage == 3 else self._index_zero12()
        else:
            self.kind, self.stage = "zero0", 0
            self._index_zero0()
        self.scalars = self._scalars()
        self.meta = self._meta()

    # ---- the interface load.py, export.py and zero_to_fp32 use (as SavedPieces) --------------------
    def names(self) -> list[str]:
        return list(self.loc)

    def shape(self, name: str) -> tuple | None:
        name = self._resolve(name)
        return tuple(self.loc[name][0]) if name in self.loc else None

    def full(self, name: str, kind: str) -> torch.Tensor:
        """The whole parameter `name` for `kind` ("master" or "state.<key>"), in fp32."""
        resolved = self._resolve(name)
        if resolved not in self.loc:
            raise CheckpointError(
                f"{self.directory} has no parameter {name!r}: the checkpoint is from a different model"
            )
        shape, where = self.loc[resolved]
        key = "fp32" if kind == "master" else kind.split(".", 1)[1]
        flat = getattr(self, f"_read_{self.kind}")(resolved, where, key)
        if flat is None:
            raise CheckpointError(f"{self.directory} has no {kind} for {name!r}; load with load_optimizer_states=False")
        return flat.reshape(-1)[: _numel(shape)].float().reshape(shape).clone()

    def state_keys(self, name: str) -> list[str]:
        return self._state_keys

    def find(self, key: str) -> torch.Tensor | None:
        """load.py's names for what is stored whole: "buffer/<name>" and "frozen/<name>@<tp rank>"."""
        kind, _, rest = key.partition("/")
        name = self._resolve(rest.split("@")[0])
        if kind == "buffer":
            return self._buffers.get(name)
        return self.frozen().get(name) if kind == "frozen" else None

    def frozen(self) -> dict[str, torch.Tensor]:
        """Parameters the optimizer does not train, whole, in the dtype DeepSpeed saved them."""
        shapes = self.model.get("frozen_param_shapes") or {}
        if self.kind == "zero0":
            return {n: t for n, t in self.model["module"].items() if n not in self.loc and n not in self._buffers}
        if not shapes:
            return {}
        if not self.zero3_files:  # ZeRO 1-2 keep them whole
            return dict(self.model.get("frozen_param_fragments") or {})
        fragments = [load(f)["frozen_param_fragments"] for f in self.zero3_files]
        return {n: torch.cat([f[n].reshape(-1) for f in fragments])[: _numel(s)].view(s) for n, s in shapes.items()}

    def buffers(self) -> dict[str, torch.Tensor]:
        return dict(self._buffers)

    def aliases(self) -> dict[str, str]:
        """Tied parameters: DeepSpeed's shared_params, {other name: the saved one}."""
        return dict(self.model.get("shared_params") or {})

    def rng(self, rank: int):
        return None  # DeepSpeed's checkpoints keep no random state

    # ---- where each parameter is --------------------------------------------------------------------
    def _param_shapes(self) -> list[dict]:
        shapes = self.model.get("param_shapes")
        if not shapes:
            raise CheckpointError(f"{self.directory}'s model states have no param_shapes: not a ZeRO checkpoint")
        return shapes if isinstance(shapes, list) else [shapes]

    def _index_zero12(self):
        paddings = self.optim[0].get("param_alignment_paddings")
        for g, shapes in enumerate(self._param_shapes()):
            offsets, _ = layout.group_offsets([_numel(s) for s in shapes.values()], paddings[g] if paddings else None)
            for (name, shape), offset in zip(shapes.items(), offsets):
                self.loc[name] = (tuple(shape), (g, offset))
        self._state_keys = _tensor_keys(_group_state(self.optim[0]["base_optimizer_state"], 0))

    def _read_zero12(self, name, where, key):
        g, offset = where
        if key == "fp32":
            chunks = [sd["single_partition_of_fp32_groups"][g] for sd in self.optim]
        else:
            chunks = [_group_state(sd["base_optimizer_state"], g).get(key) for sd in self.optim]
        return None if chunks[0] is None else _span(chunks, offset, offset + _numel(self.loc[name][0]))

    def _index_zero3(self):
        world, offset = len(self.optim), 0
        for shapes in self._param_shapes():
            for name, shape in shapes.items():
                self.loc[name] = (tuple(shape), offset)
                offset += layout.zero3_piece_numel(_numel(shape), world)
        self._state_keys = _tensor_keys(_group_state(self.optim[0]["optimizer_state_dict"], 0))

    def _read_zero3(self, name, offset, key):
        piece = layout.zero3_piece_numel(_numel(self.loc[name][0]), len(self.optim))
        pieces = []
        for sd in self.optim:
            if key == "fp32":
                chunks = sd["fp32_flat_groups"]
            else:
                states = sd["optimizer_state_dict"]["state"]
                chunks = [states[j].get(key) for j in sorted(states)]
                if chunks[0] is None:
                    return None
            pieces.append(_span(chunks, offset, offset + piece))
        return torch.cat(pieces)

    def _index_zero0(self):
        module = self.model["module"]
        names = [n for n in module if n not in self._buffers]
        optimizer = self.model.get("optimizer") or {}
        torch_sd = optimizer.get("optimizer_state_dict", optimizer)  # bf16/fp16 wrap the torch optimizer's
        masters = [t for group in optimizer.get("fp32_groups", []) for t in group]
        order = [i for group in torch_sd.get("param_groups", []) for i in group["params"]]
        self._zero0_state = torch_sd.get("state", {})
        if len(order) > len(names):
            raise CheckpointError(f"{self.directory}: the optimizer has more parameters than the module saved")
        for position, (name, index) in enumerate(zip(names, order)):
            master = masters[position] if masters else module[name]
            state = self._zero0_state.get(index, {})
            for value in [master, *(v for v in state.values() if torch.is_tensor(v) and v.dim() > 0)]:
                if value.numel() != module[name].numel():
                    raise CheckpointError(
                        f"{self.directory}: the optimizer's parameter {index} does not have the shape of module "
                        f"parameter {name!r} {tuple(module[name].shape)}: its parameters were not the module's, "
                        "in the module's order (DeepSpeed stores no names at ZeRO stage 0)"
                    )
            self.loc[name] = (tuple(module[name].shape), (index, master))
        self._state_keys = _tensor_keys(next(iter(self._zero0_state.values()), {}))

    def _read_zero0(self, name, where, key):
        index, master = where
        return master if key == "fp32" else self._zero0_state.get(index, {}).get(key)

    def _zero_settings(self) -> dict:
        path = self.directory / layout.UNIVERSAL_DIR / "optimizer_state.pt"
        return load(path) if path.exists() else {}

    def _index_universal(self):
        root = self.directory / layout.UNIVERSAL_DIR
        for shapes in self._param_shapes():
            for name, shape in shapes.items():
                if not (root / name / "fp32.pt").exists():
                    raise CheckpointError(
                        f"{root / name / 'fp32.pt'} is missing: the universal checkpoint is incomplete"
                    )
                self.loc[name] = (tuple(shape), root / name)
        first = root / next(iter(self.loc))
        self._state_keys = sorted(p.stem for p in first.glob("*.pt") if p.stem not in ("fp32", "step"))

    def _read_universal(self, name, folder, key):
        path = folder / f"{key}.pt"
        if not path.exists():
            return None
        value = load(path)
        value = value["param"] if isinstance(value, dict) else value
        if _numel(value.shape) != _numel(self.loc[name][0]):
            raise CheckpointError(
                f"{path} holds {tuple(value.shape)}, not {name!r}'s {self.loc[name][0]}: a tensor-parallel slice? "
                "zerotron reads universal checkpoints of whole parameters"
            )
        return value

    # ---- everything else a resume needs --------------------------------------------------------------
    def _scalars(self) -> dict:
        """Per-parameter optimizer scalars (Adam's step), one value for all."""
        if self.kind == "universal":
            steps = [p for p in (self.directory / layout.UNIVERSAL_DIR).glob("*/step.pt")]
            if steps:
                step = load(steps[0])
                return {"step": float(step["param"] if isinstance(step, dict) else step)}
            return _step_of(self._zero_settings())
        if self.kind == "zero0":
            return _step_of({"state": self._zero0_state})
        return _step_of(self.optim[0])

    def _settings(self) -> dict:
        """The wrapper's settings: loss scaler and the torch optimizer's param groups."""
        if self.kind == "zero0":
            return self.model.get("optimizer") or {}
        return self._zero_settings() if self.kind == "universal" else self.optim[0]

    def _meta(self) -> dict:
        m, settings = self.model, self._settings()
        inner = settings.get("base_optimizer_state", settings.get("optimizer_state_dict", settings))
        groups = inner if isinstance(inner, list) else inner.get("param_groups", settings.get("param_groups", []))
        config = m.get("ds_config") or {}
        dtype = "bf16" if _enabled(config, "bf16", "bfloat16") else "fp16" if _enabled(config, "fp16") else "fp32"
        return {
            "format": "deepspeed",
            "tag": self.directory.name,
            "world_size": m.get("dp_world_size", 1),
            "topology": {"dp": m.get("dp_world_size", 1), "sp": 1, "cp": 1, "tp": 1, "pp": 1},
            "zero_stage": self.stage,
            "dtype": dtype,
            "counters": {k: m.get(k, 0) for k in ("global_steps", "global_samples", "skipped_steps")},
            "loss_scaler": _loss_scaler(settings),
            "lr_scheduler": m.get("lr_scheduler"),
            "optimizer_groups": [
                {k: v for k, v in g.items() if k not in layout.IMPLEMENTATION_KEYS}
                for g in groups
                if isinstance(g, dict)
            ],
            "data": None,
            "hf_config": None,
            "client_state": {k: v for k, v in m.items() if k not in _DEEPSPEED_STATES},
            "files": {},
        }

    def _resolve(self, name: str) -> str:
        """DeepSpeed saves the module's names; a model wrapped in another module gains a "module." prefix."""
        if name in self.loc or name in self._buffers:
            return name
        for candidate in (name.removeprefix("module."), "module." + name):
            if candidate in self.loc or candidate in self._buffers:
                return candidate
        return name


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _span(chunks: list[torch.Tensor], lo: int, hi: int) -> torch.Tensor:
    """[lo, hi) of the concatenation of `chunks`, reading only the chunks it touches."""
    parts, start = [], 0
    for chunk in chunks:
        end = start + chunk.numel()
        if end > lo and start < hi:
            parts.append(chunk.reshape(-1)[max(lo, start) - start : min(hi, end) - start])
        start = end
    if start < hi:
        raise CheckpointError(f"a flat partition ends at {start}, before {hi}: the checkpoint is incomplete")
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def _group_state(base, g: int) -> dict:
    """Group g's optimizer state: DeepSpeed keeps a torch state dict ({"state": {g: ...}}) or, in its
    elastic form, a list of per-group states."""
    return base[g] if isinstance(base, list) else base["state"].get(g, {})


def _tensor_keys(state: dict) -> list[str]:
    return sorted(k for k, v in state.items() if torch.is_tensor(v) and v.dim() > 0)


def _step_of(settings: dict) -> dict:
    for inner in (settings.get("base_optimizer_state"), settings.get("optimizer_state_dict"), settings):
        if isinstance(inner, list) and inner and "step" in inner[0]:
            return {"step": float(inner[0]["step"])}
        if isinstance(inner, dict) and inner.get("state"):
            first = next(iter(inner["state"].values()))
            if "step" in first:
                return {"step": float(first["step"])}
    if "base_optimizer_state_step" in settings:  # DeepSpeed's FusedAdam keeps one step per group
        return {"step": float(settings["base_optimizer_state_step"])}
    logger.warning("the DeepSpeed checkpoint has no optimizer step count: Adam's bias correction restarts")
    return {}


def _loss_scaler(settings: dict) -> dict:
    """zerotron's loss-scaler state from DeepSpeed's scaler object (ZeRO) or its fields (stage 0)."""
    scaler = settings.get("loss_scaler")
    fields = dict(vars(scaler)) if scaler is not None else settings
    names = {"cur_scale": "scale", "cur_iter": "iteration", "last_overflow_iter": "last_overflow"}
    names["cur_hysteresis"] = "hysteresis_left"
    state = {ours: fields[theirs] for theirs, ours in names.items() if theirs in fields}
    return {k: float(v) if k == "scale" else int(v) for k, v in state.items()}


def _enabled(config: dict, *keys) -> bool:
    return any(isinstance(config.get(k), dict) and config[k].get("enabled", False) for k in keys)
