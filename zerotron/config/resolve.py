"""Reading a config as given (a path, JSON text, a dict or a Config) and resolving its "auto"
values the way the Hugging Face Trainer does; parsing raw sections into the typed dataclasses."""

from __future__ import annotations

import copy
import dataclasses
import difflib
import json
import math
import typing

from ..errors import ConfigError
from ..log import warn
from .deepspeed import DEEPSPEED_TOP_LEVEL
from .no_effect import ACCEPTED_NO_EFFECT
from .sections import AUTO, IntOrInf, as_bool, is_auto


def parse_json(text: str, where: str) -> dict:
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError("config", where, f"not valid JSON ({e}); fix the file") from None
    if not isinstance(raw, dict):
        raise ConfigError("config", where, "the JSON must be an object at the top level")
    return raw


# --------------------------------------------------------------------------------------------
# "auto" values: (path, name in auto_values, what to do when the caller gave no value)
# --------------------------------------------------------------------------------------------
_DROP = object()  # fall back to the key's default (or derive it, for the batch triple)
_REQUIRED = object()  # no sensible default: the user must say

_AUTO_RULES = [
    ("train_batch_size", "train_batch_size", _DROP),
    ("train_micro_batch_size_per_gpu", "micro_batch_size", _DROP),
    ("gradient_accumulation_steps", "gradient_accumulation_steps", _DROP),
    ("gradient_clipping", "max_grad_norm", _DROP),
    ("fp16.enabled", "fp16", _DROP),
    ("bf16.enabled", "bf16", _DROP),
    ("optimizer.params.lr", "lr", _DROP),
    ("optimizer.params.betas", "betas", _DROP),
    ("optimizer.params.eps", "eps", _DROP),
    ("optimizer.params.weight_decay", "weight_decay", _DROP),
    ("scheduler.params.warmup_min_lr", "warmup_min_lr", 0.0),
    ("scheduler.params.warmup_max_lr", "lr", "optimizer.params.lr"),
    ("scheduler.params.warmup_num_steps", "warmup_steps", _DROP),
    ("scheduler.params.total_num_steps", "total_steps", _REQUIRED),
    ("pipeline.stages", "pipeline_stages", 1),
    ("zero_optimization.reduce_bucket_size", "reduce_bucket_size", _DROP),
    ("zero_optimization.stage3_prefetch_bucket_size", "stage3_prefetch_bucket_size", _DROP),
    ("zero_optimization.stage3_param_persistence_threshold", "stage3_param_persistence_threshold", _DROP),
]
_OPTIMIZER_DEFAULTS = {"lr": 1e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0}
_AUTO_MEANS_DEFAULT = {
    "zero_optimization",
    "fp16",
    "bf16",
    "bfloat16",
    "tensorboard",
    "wandb",
    "csv_monitor",
    "comet",
    "comms_logger",
    "compile",
    "hybrid_engine",
    "tensor_parallel",
    "timers",
}


def resolve_auto(raw: dict, **values) -> dict:
    """Replace "auto" values in a raw DeepSpeed config dict.

    `values` use the names a training script knows: micro_batch_size, gradient_accumulation_steps,
    train_batch_size, lr, betas, eps, weight_decay, max_grad_norm, fp16, bf16, warmup_steps,
    total_steps, warmup_min_lr, and hidden_size (which sets the ZeRO bucket sizes the way the
    Transformers Trainer does). A None value counts as not given. Keys with nothing to resolve
    from fall back to their defaults, as do all other "auto" values inside the sections DeepSpeed
    parses with its pydantic models (zero_optimization, fp16, bf16, the monitors, tensor_parallel,
    ...), where DeepSpeed reads "auto" as the default; keys without a sensible default raise ConfigError.
    """
    raw = copy.deepcopy(raw)
    known = {name for _, name, _ in _AUTO_RULES} | {"hidden_size"}
    unknown = sorted(set(values) - known)
    if unknown:
        raise TypeError(f"resolve_auto got unknown value names {unknown}; known: {sorted(known)}")
    values = {k: v for k, v in values.items() if v is not None}
    hidden = values.pop("hidden_size", None)
    if hidden is not None:
        values.setdefault("reduce_bucket_size", hidden * hidden)
        values.setdefault("stage3_prefetch_bucket_size", int(0.9 * hidden * hidden))
        values.setdefault("stage3_param_persistence_threshold", 10 * hidden)
    for path, name, fallback in _AUTO_RULES:
        parent, key = _walk(raw, path)
        if parent is None or not is_auto(parent.get(key)):
            continue
        if name in values:
            parent[key] = values[name]
        elif fallback is _DROP:
            if path.startswith("optimizer.params."):
                parent[key] = _OPTIMIZER_DEFAULTS[key]
            else:
                del parent[key]
        elif fallback is _REQUIRED:
            raise ConfigError(
                path,
                AUTO,
                f"nothing to resolve it from; set a number or pass {name}=... to zerotron.resolve_auto(config, ...)",
            )
        elif isinstance(fallback, str):  # another key's (resolved) value
            src_parent, src_key = _walk(raw, fallback)
            src = None if src_parent is None else src_parent.get(src_key)
            parent[key] = _OPTIMIZER_DEFAULTS["lr"] if src is None or is_auto(src) else src
        else:
            parent[key] = fallback
    for path in list(_auto_paths(raw, "")):
        # In the sections DeepSpeed reads through its pydantic models, "auto" means the default
        # (DeepSpeedConfigModel drops such values), e.g. zero_optimization.stage3_max_live_parameters.
        if path.split(".")[0] in _AUTO_MEANS_DEFAULT:
            parent, key = _walk(raw, path)
            del parent[key]
    left = [p for p in _auto_paths(raw, "")]
    if left:
        raise ConfigError(left[0], AUTO, "zerotron cannot resolve 'auto' for this key; set a value")
    return raw


def _walk(raw: dict, path: str):
    *parents, key = path.split(".")
    node = raw
    for part in parents:
        node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict):
            return None, key
    return node, key


def _auto_paths(node, prefix):
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _auto_paths(v, f"{prefix}{k}" if not prefix else f"{prefix}.{k}")
    elif is_auto(node):
        yield prefix


# --------------------------------------------------------------------------------------------
# Typed parsing of dataclass sections
# --------------------------------------------------------------------------------------------
def parse_section(cls, raw: dict, prefix: str):
    if not isinstance(raw, dict):
        raise ConfigError(prefix.rstrip(".") or "config", raw, "expected a JSON object here")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls) if f.name not in ("raw", "world_size")}
    accepted = ACCEPTED_NO_EFFECT.get(prefix.rstrip("."), set())
    kwargs, unknown = {}, []
    for key, value in raw.items():
        if key in names:
            kwargs[key] = _convert(hints[key], value, prefix + key)
        elif key not in accepted:
            unknown.append(key)
    if prefix:
        for key in unknown:  # inside a section zerotron knows, as DeepSpeed's config models do
            raise ConfigError(prefix + key, raw[key], _not_a_key(key, prefix.rstrip("."), sorted(names | accepted)))
    else:
        _top_level_unknown(unknown, raw, names | accepted)
    return cls(**kwargs)


def _not_a_key(key: str, section: str, valid: list[str]) -> str:
    near = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
    if near:
        return f"{section} has no key '{key}'; did you mean '{near[0]}'? Rename it (or remove it)"
    return f"{section} has no key '{key}'; remove it (its keys: {', '.join(valid)})"


def _top_level_unknown(unknown: list[str], raw: dict, known: set[str]):
    """A top-level key that is neither zerotron's nor DeepSpeed's but close to one is a typo (an
    error, as "train_micro_batch_size_per_gpus" would otherwise train with the default batch); the
    other unknown sections are named in a warning."""
    for key in unknown:
        near = difflib.get_close_matches(key, sorted(known | DEEPSPEED_TOP_LEVEL), n=1, cutoff=0.8)
        if near and key not in DEEPSPEED_TOP_LEVEL:
            raise ConfigError(key, raw[key], f"not a config key; did you mean '{near[0]}'? Rename it (or remove it)")
    if unknown:
        warn(
            f"zerotron ignores these top-level config sections, which are neither DeepSpeed's nor "
            f"zerotron's: {', '.join(unknown)}"
        )


def _convert(tp, value, key: str):
    origin = typing.get_origin(tp)
    if origin is typing.Union:  # Optional[X]
        inner = [a for a in typing.get_args(tp) if a is not type(None)][0]
        return None if value is None else _convert(inner, value, key)
    if dataclasses.is_dataclass(tp):
        return parse_section(tp, value, key + ".")
    if tp is bool:
        flag = as_bool(value)
        if flag is None:
            raise ConfigError(key, value, "expected true or false (or 1 / 0)")
        return flag
    if tp is IntOrInf:
        if value == math.inf or (isinstance(value, str) and value.strip().lower() in ("inf", "infinity")):
            return math.inf
        tp = int
    if tp is int:
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or (isinstance(value, float) and not value.is_integer())
        ):
            raise ConfigError(key, value, "expected an integer")
        return int(value)
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ConfigError(key, value, "expected a finite number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(key, value, "expected a string")
        return value
    if tp is list or origin is list:
        if not isinstance(value, list):
            raise ConfigError(key, value, "expected a JSON array")
        return list(value)
    if tp is dict or origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(key, value, "expected a JSON object")
        return dict(value)
    return value
