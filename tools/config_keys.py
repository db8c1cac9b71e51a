"""Every key of a DeepSpeed config, classified: used by zerotron, no effect (reviewed: zerotron/config/no_effect.py
says why), warned about (with what to do instead), refused (an error), or silently ignored (none of these; the
goal is none). tools/config_survey.py prints the counts over the configs it finds."""

from __future__ import annotations

import collections
import functools
import json
import os
import re
import warnings

from tools.config_survey import BATCH_KEYS, HF_AUTO, warned_keys

KEY_CLASSES = ("used", "no effect", "warned", "error", "silently ignored")


def key_paths(raw: dict, prefix: str = "", cls=None) -> list[str]:
    """The config's keys as dotted paths: into the sections zerotron parses (typed dataclasses) and into
    optimizer/scheduler params; any other object value is one key."""
    import dataclasses
    import typing

    from zerotron.config import Config

    cls = cls or Config
    hints = typing.get_type_hints(cls) if dataclasses.is_dataclass(cls) else {}
    out = []
    for key, value in raw.items():
        path = prefix + key
        inner = [a for a in typing.get_args(hints.get(key)) if a is not type(None)] or [hints.get(key)]
        if isinstance(value, dict) and dataclasses.is_dataclass(inner[0]):
            out += key_paths(value, path + ".", inner[0]) or [path]
        elif isinstance(value, dict) and path in ("optimizer.params", "scheduler.params"):
            out += [f"{path}.{k}" for k in value] or [path]
        else:
            out.append(path)
    return out


def load_keys(raw: dict, world_size: int) -> tuple[list[str], list[str]]:
    """(the keys zerotron refuses, the warnings of loading the rest): each refused key is dropped and the
    config loaded again, so one refusal does not hide how the other keys fare."""
    import zerotron

    errors = []
    for _ in range(20):
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            try:
                zerotron.Config.load(raw, world_size=world_size, **HF_AUTO)
                return errors, [str(w.message) for w in record]
            except zerotron.ConfigError as e:
                key = "optimizer" if e.key.startswith("optimizer.") else e.key  # a refused optimizer: all of it
                if not _drop(raw, key):
                    return errors + [e.key], []
                errors.append(key)
    return errors, []


def _drop(raw: dict, path: str) -> bool:
    *parents, key = path.split(".")
    node = raw
    for part in parents:
        node = node.get(part) if isinstance(node, dict) else None
    if not isinstance(node, dict) or key not in node or path in BATCH_KEYS:
        return False
    del node[key]
    return True


def classify_keys(raw: dict, world_size: int) -> dict[str, str]:
    """{key path: class} for one config (see KEY_CLASSES)."""
    import dataclasses

    from zerotron.config import Config, deepspeed, no_effect

    paths = key_paths(raw)
    errors, texts = load_keys(json.loads(json.dumps(raw)), world_size)
    warned = {w.split(": ", 1)[1] if ": " in w else w.removeprefix("unknown key ") for w in warned_keys(texts)}
    renamed = {a for a, _ in deepspeed._ZERO_ALIASES} | {
        "cpu_offload",
        "cpu_offload_param",
        "cpu_offload_use_pin_memory",
    }
    handled = {"autotuning", "bfloat16", "zerotron", "optimizer", "scheduler"}  # applied by initialize / renamed
    honored_off = ("progressive_layer_drop", "curriculum_learning", "elasticity")  # refused when enabled
    fields, parsed = {f.name for f in dataclasses.fields(Config)}, set(parsed_fields())
    out = {}
    for p in paths:
        top, last = p.split(".")[0], p.rsplit(".", 1)[-1]
        section = p.rsplit(".", 1)[0] if "." in p else ""
        if any(p == e or p.startswith(e + ".") for e in errors):
            out[p] = "error"
        elif p in warned or top in warned or any(f"{p} " in t or f"{p}:" in t for t in texts):
            out[p] = "warned"
        elif p in no_effect.PARSED_NO_EFFECT or last in no_effect.ACCEPTED_NO_EFFECT.get(section, ()) or _off(raw, p):
            out[p] = "no effect"
        elif p in no_effect.ONLY_AT or p in no_effect.ONLY_AT_DEFAULT:
            out[p] = "no effect"  # at the value that changes nothing (else warned above)
        elif p in parsed:
            out[p] = "used" if read_by_zerotron(p) else "silently ignored"
        elif top in fields or top in handled or top in honored_off or last in renamed:
            out[p] = "used"
        elif top in ("gradient_allreduce_op", "managed_gradient_accumulation"):
            out[p] = "used"  # at their default (refused otherwise)
        else:
            out[p] = "silently ignored"
    return out


def parsed_fields(cls=None, prefix=""):
    """Every key zerotron parses into a typed section, as a dotted path."""
    import dataclasses
    import typing

    from zerotron.config import Config

    cls = cls or Config
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name not in ("raw", "world_size"):
            tp = ([a for a in typing.get_args(hints[f.name]) if a is not type(None)] or [hints[f.name]])[0]
            yield from parsed_fields(tp, f"{prefix}{f.name}.") if dataclasses.is_dataclass(tp) else [prefix + f.name]


@functools.cache
def _code() -> str:
    top = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "zerotron")
    return "\n".join(
        open(os.path.join(root, n)).read()
        for root, _, names in os.walk(top)
        if os.path.basename(root) != "config"
        for n in names
        if n.endswith(".py")
    )


def read_by_zerotron(path: str) -> bool:
    """Whether code outside the config package reads the parsed key (`.name` appears in it): a static
    test, generous for common names, that catches a key nothing reads."""
    return re.search(rf"\.{path.rsplit('.', 1)[-1]}\b", _code()) is not None


def _off(raw: dict, path: str) -> bool:
    """A section of a feature zerotron does not implement, present but disabled: it asks for nothing."""
    from zerotron.config import deepspeed

    top = path.split(".")[0]
    return top in deepspeed._NOT_IMPLEMENTED and isinstance(raw.get(top), dict) and raw[top].get("enabled") is False


def key_survey(rows_raw) -> tuple[collections.Counter, dict]:
    """Counts per class over every key of every config, and the keys of each class (for the report)."""
    counts, examples = collections.Counter(), collections.defaultdict(collections.Counter)
    for raw, world in rows_raw:
        for p, c in classify_keys(raw, world).items():
            counts[c] += 1
            examples[c][p] += 1
    return counts, examples
