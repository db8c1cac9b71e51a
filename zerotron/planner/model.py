"""A model as the planner sees it: a decoder-only transformer by its shape.

From a zerotron size (`1.3b`), a named public architecture (`llama3-8b`), a Hugging Face
`config.json`, or a shape written out (`layers=32,hidden=4096,heads=32,vocab=32000`).
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, fields
from pathlib import Path


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    tied: bool = False
    gated: bool = True  # SwiGLU-style MLP with three matrices (False: two, as in GPT-2/GPT-3)

    def __post_init__(self):
        if min(self.layers, self.hidden, self.heads, self.kv_heads, self.ffn, self.vocab) < 1:
            raise ValueError(f"every model dimension must be positive: {self}")
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ValueError(
                f"hidden ({self.hidden}) must divide by heads ({self.heads}), and heads by kv_heads ({self.kv_heads})"
            )

    @classmethod
    def of_gpt(cls, cfg) -> "ModelShape":
        return cls(cfg.n_layer, cfg.d_model, cfg.n_head, cfg.n_kv_head, cfg.ffn, cfg.vocab_size, cfg.tie_embeddings)

    @classmethod
    def from_hf_config(cls, config: dict) -> "ModelShape":
        """From a Hugging Face config.json (Llama/Mistral/Qwen-style or GPT-2-style keys)."""

        def key(*names, default=None):
            for n in names:
                if config.get(n) is not None:
                    return config[n]
            if default is None:
                raise ValueError(f"the model config has none of {', '.join(names)}")
            return default

        hidden = key("hidden_size", "n_embd", "d_model")
        heads = key("num_attention_heads", "n_head")
        gated = "intermediate_size" in config
        return cls(
            layers=key("num_hidden_layers", "n_layer"),
            hidden=hidden,
            heads=heads,
            kv_heads=key("num_key_value_heads", default=heads),
            ffn=key("intermediate_size", "n_inner", "ffn_dim", default=4 * hidden),
            vocab=key("vocab_size"),
            tied=bool(config.get("tie_word_embeddings", not gated)),
            gated=gated,
        )

    @classmethod
    def parse(cls, spec: str) -> "ModelShape":
        """A zerotron size, a named architecture, a path to a config.json (or its directory), or
        `layers=..,hidden=..,heads=..,vocab=..[,kv_heads=..][,ffn=..][,tied=1][,gated=0]`."""
        from ..models.gpt import SIZES, config_for

        if spec in SIZES:
            return cls.of_gpt(config_for(spec))
        if spec in ARCHITECTURES:
            return ARCHITECTURES[spec]
        path = Path(spec)
        if path.is_dir():
            path = path / "config.json"
        if path.suffix == ".json":
            if not path.exists():
                raise FileNotFoundError(f"no model config at {path}")
            return cls.from_hf_config(json.loads(path.read_text()))
        if "=" in spec:
            names = {f.name for f in fields(cls)}
            values = dict(item.split("=", 1) for item in spec.split(","))
            unknown = set(values) - names
            if unknown:
                raise ValueError(
                    f"unknown model dimension(s) {', '.join(sorted(unknown))}; use {', '.join(sorted(names))}"
                )
            v = {k: int(x) for k, x in values.items()}
            v.setdefault("kv_heads", v.get("heads", 1))
            v.setdefault(
                "ffn", 32 * math.ceil(8 * v.get("hidden", 1) / 3 / 32) if v.get("gated", 1) else 4 * v.get("hidden", 1)
            )
            missing = {"layers", "hidden", "heads", "vocab"} - set(v)
            if missing:
                raise ValueError(f"the model shape needs {', '.join(sorted(missing))}")
            return cls(**{k: (bool(x) if k in ("tied", "gated") else x) for k, x in v.items()})
        raise ValueError(
            f"unknown model {spec!r}: give a zerotron size ({', '.join(SIZES)}), an architecture "
            f"({', '.join(ARCHITECTURES)}), a config.json path, or layers=..,hidden=..,heads=..,vocab=.."
        )

    @functools.lru_cache(maxsize=64)  # noqa: B019 (shapes are few, frozen and hashable)
    def tensors(self) -> tuple[tuple[str, int, bool], ...]:
        """(where, elements, split by tensor parallelism) for every parameter tensor, in order:
        where is "embed", "block" or "head". Bias-free, RMS-normed (the reference GPT)."""
        d, kv = self.hidden, self.hidden // self.heads * self.kv_heads
        mlp = [(d * self.ffn, True)] * (3 if self.gated else 2)
        block = [(d, False), (d * d, True), (d * kv, True), (d * kv, True), (d * d, True), (d, False), *mlp]
        out = [("embed", self.vocab * d, True)]
        for _ in range(self.layers):
            out += [("block", n, split) for n, split in block]
        out.append(("head", d, False))  # final norm
        if not self.tied:
            out.append(("head", self.vocab * d, True))
        return tuple(out)

    def linears(self, fused_qkv: bool = False) -> tuple[int, ...]:
        """Elements of each of a block's matrices, in the order its forward multiplies by them: q, k,
        v (one query_key_value matrix when `fused_qkv`, as Megatron's attention has it), the output
        projection, then the MLP's (gate, up, down; or up, down)."""
        d, kv = self.hidden, self.hidden // self.heads * self.kv_heads
        attention = (d * d + 2 * d * kv,) if fused_qkv else (d * d, d * kv, d * kv)
        return attention + (d * d,) + (d * self.ffn,) * (3 if self.gated else 2)

    @property
    def tensors_per_block(self) -> int:
        return 6 + (3 if self.gated else 2)

    @functools.cached_property
    def parameters(self) -> int:
        return sum(n for _, n, _ in self.tensors())

    def flops_per_token(self, seq: int) -> float:
        """6N + 12·L·d·s, N without the embedding lookup (as GPT.flops_per_token)."""
        n = self.parameters - (0 if self.tied else self.vocab * self.hidden)
        return 6 * n + 12 * self.layers * self.hidden * seq


# Public architectures by name (shapes from their published configs), for planning without files.
ARCHITECTURES = {
    "llama2-7b": ModelShape(32, 4096, 32, 32, 11008, 32000),
    "llama2-13b": ModelShape(40, 5120, 40, 40, 13824, 32000),
    "llama2-70b": ModelShape(80, 8192, 64, 8, 28672, 32000),
    "llama3-8b": ModelShape(32, 4096, 32, 8, 14336, 128256),
    "llama3-70b": ModelShape(80, 8192, 64, 8, 28672, 128256),
    "llama3-405b": ModelShape(126, 16384, 128, 8, 53248, 128256),
    "gpt3-175b": ModelShape(96, 12288, 96, 96, 4 * 12288, 51200, tied=True, gated=False),
}
