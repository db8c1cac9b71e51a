"""A model as the planner sees it: a decoder-only transformer by its shape.

From a zerotron size (`1.3b`, `moe-small`), a named public architecture (`llama3-8b`), a Hugging Face
`config.json`, or a shape written out (`layers=32,hidden=4096,heads=32,vocab=32000`).

A mixture of experts (`experts` > 0) replaces every block's MLP by a router (hidden x experts) and
`experts` MLPs of `expert_ffn` each, stacked expert first as zerotron's reference MoE and Transformers'
MoE families hold them, of which each token runs `top_k`; `shared_ffn` is a dense MLP every token runs
beside them (Qwen2-MoE's shared expert, DeepSeek's n_shared_experts x moe_intermediate_size).
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
    experts: int = 0  # routed experts per block (0: a dense MLP of `ffn`)
    top_k: int = 0  # experts each token runs
    expert_ffn: int = 0  # each expert's hidden size
    shared_ffn: int = 0  # the hidden size of the MLP every token runs beside the routed experts (0: none)
    # fp32 copies of the logits the model's loss holds beyond the logits and their gradient, which zerotron's
    # models hold (Transformers' causal-LM loss: the shifted logits and the log-softmax, 2; measured 4.1x the
    # logits at the peak of a GPT-2's forward and backward)
    loss_copies: int = 0

    def __post_init__(self):
        if min(self.layers, self.hidden, self.heads, self.kv_heads, self.ffn, self.vocab) < 1:
            raise ValueError(f"every model dimension must be positive: {self}")
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ValueError(
                f"hidden ({self.hidden}) must divide by heads ({self.heads}), and heads by kv_heads ({self.kv_heads})"
            )
        if self.experts and not (1 <= self.top_k <= self.experts and self.expert_ffn >= 1 and self.shared_ffn >= 0):
            raise ValueError(
                f"a mixture of {self.experts} experts needs 1 <= top_k <= experts (top_k={self.top_k}) and "
                f"expert_ffn >= 1 (expert_ffn={self.expert_ffn}); set them, e.g. experts=8,top_k=2,expert_ffn=14336"
            )
        if not self.experts and (self.top_k or self.expert_ffn or self.shared_ffn):
            raise ValueError(
                f"top_k, expert_ffn and shared_ffn describe a mixture of experts; set experts (> 0) too, or leave "
                f"them out for a dense MLP ({self})"
            )

    @classmethod
    def of_gpt(cls, cfg) -> "ModelShape":
        moe = dict(experts=cfg.n_experts, top_k=cfg.top_k, expert_ffn=cfg.expert_hidden) if cfg.n_experts else {}
        return cls(
            cfg.n_layer, cfg.d_model, cfg.n_head, cfg.n_kv_head, cfg.ffn, cfg.vocab_size, cfg.tie_embeddings, **moe
        )

    @classmethod
    def from_hf_config(cls, config: dict) -> "ModelShape":
        """From a Hugging Face config.json (Llama/Mistral/Qwen-style, GPT-2-style or DistilBERT/MPT-style keys;
        mixtures of experts with Mixtral's, Qwen2/3-MoE's or DeepSeek's keys, every block a mixture)."""

        def key(*names, default=None):
            for n in names:
                if config.get(n) is not None:
                    return config[n]
            if default is None:
                raise ValueError(f"the model config has none of {', '.join(names)}")
            return default

        # config.json holds a model's own names: DistilBERT's dim / n_heads / n_layers are what its config class
        # maps hidden_size etc. to (its attribute_map), and to_dict() gives them unmapped too
        hidden = key("hidden_size", "n_embd", "d_model", "dim")
        heads = key("num_attention_heads", "n_head", "n_heads")
        # A gated MLP (three matrices): SiLU families (Llama, Mistral, Qwen, Mixtral, DeepSeek) and Gemma's GeGLU.
        # intermediate_size alone does not say it: BERT, DeBERTa, GPT-NeoX, Phi-2 and StarCoder2 name their
        # two-matrix GELU MLP so too.
        act = str(config.get("hidden_act") or config.get("hidden_activation") or "")
        gated = "intermediate_size" in config and (
            act in ("", "silu", "swish") or str(config.get("model_type", "")).startswith("gemma")
        )
        ffn = key("intermediate_size", "n_inner", "ffn_dim", "hidden_dim", default=4 * hidden)  # DistilBERT: hidden_dim
        moe = {}
        experts = key("num_local_experts", "num_experts", "n_routed_experts", default=0)
        if experts:
            # Qwen-MoE and DeepSeek size their experts by moe_intermediate_size (intermediate_size is
            # then their dense layers'), Mixtral by intermediate_size
            expert_ffn = key("moe_intermediate_size", default=ffn)
            shared = key("shared_expert_intermediate_size", default=0) or (
                key("n_shared_experts", default=0) * expert_ffn
            )
            moe = dict(
                experts=experts,
                top_k=key("num_experts_per_tok", "experts_per_token"),
                expert_ffn=expert_ffn,
                shared_ffn=shared,
            )
        return cls(
            layers=key("num_hidden_layers", "n_layer", "n_layers"),
            hidden=hidden,
            heads=heads,
            kv_heads=key("num_key_value_heads", default=heads),
            ffn=ffn,
            vocab=key("vocab_size"),
            tied=bool(config.get("tie_word_embeddings", not gated)),
            gated=gated,
            **moe,
        )

    @classmethod
    def parse(cls, spec: str) -> "ModelShape":
        """A zerotron size, a named architecture, a path to a config.json (or its directory), or
        `layers=..,hidden=..,heads=..,vocab=..[,kv_heads=..][,ffn=..][,tied=1][,gated=0]`, with a
        mixture of experts `[,experts=..[,top_k=..(2)][,expert_ffn=..(ffn)][,shared_ffn=..]]`."""
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
            if v.get("experts"):
                v.setdefault("top_k", min(2, v["experts"]))
                v.setdefault("expert_ffn", v["ffn"])
            missing = {"layers", "hidden", "heads", "vocab"} - set(v)
            if missing:
                raise ValueError(f"the model shape needs {', '.join(sorted(missing))}")
            return cls(**{k: (bool(x) if k in ("tied", "gated") else x) for k, x in v.items()})
        raise ValueError(
            f"unknown model {spec!r}: give a zerotron size ({', '.join(SIZES)}), an architecture "
            f"({', '.join(ARCHITECTURES)}), a config.json path, or layers=..,hidden=..,heads=..,vocab=.."
        )

    @property
    def mlp_matrices(self) -> int:
        """Matrices of one MLP (or expert): gate, up and down; or up and down."""
        return 3 if self.gated else 2

    @functools.cached_property
    def block(self) -> tuple[tuple[str, int, bool], ...]:
        """One block's tensors in module order, as `tensors()` lists them. A mixture's are its router,
        then its experts' stacked tensors (gate and up in one, as Transformers and the reference hold
        them; where "expert": split over expert-parallel ranks, kept whole by tensor parallelism, as
        zerotron's plans keep them), then the shared MLP."""
        d, kv = self.hidden, self.hidden // self.heads * self.kv_heads
        attention = [(d, False), (d * d, True), (d * kv, True), (d * kv, True), (d * d, True), (d, False)]
        if not self.experts:
            mlp = [(d * self.ffn, True)] * self.mlp_matrices
            return tuple(("block", n, split) for n, split in attention + mlp)
        stacked = self.experts * d * self.expert_ffn
        experts = [2 * stacked, stacked] if self.gated else [stacked, stacked]
        return (
            *(("block", n, split) for n, split in attention),
            ("block", d * self.experts, False),  # the router
            *(("expert", n, False) for n in experts),
            *(("block", d * self.shared_ffn, True) for _ in range(self.mlp_matrices if self.shared_ffn else 0)),
        )

    @functools.lru_cache(maxsize=64)  # noqa: B019 (shapes are few, frozen and hashable)
    def tensors(self) -> tuple[tuple[str, int, bool], ...]:
        """(where, elements, split by tensor parallelism) for every parameter tensor, in order:
        where is "embed", "block", "expert" (a block's stacked experts) or "head". Bias-free,
        RMS-normed (the reference GPT)."""
        out = [("embed", self.vocab * self.hidden, True)]
        out += list(self.block) * self.layers
        out.append(("head", self.hidden, False))  # final norm
        if not self.tied:
            out.append(("head", self.vocab * self.hidden, True))
        return tuple(out)

    def layer_elements(self, tp: int = 1, ep: int = 1) -> tuple[int, int]:
        """(dense, expert) elements of one block on one rank: tensor-split ones over `tp`, the experts
        over `ep` (ZeRO-3 gathers each part over its own group)."""
        dense = sum(-(-n // tp) if split else n for where, n, split in self.block if where == "block")
        return dense, sum(n for where, n, _ in self.block if where == "expert") // ep

    def linears(self, fused_qkv: bool = False) -> tuple[int, ...]:
        """Elements of each of a block's matrices a token multiplies by, in the order its forward does:
        q, k, v (one query_key_value matrix when `fused_qkv`, as Megatron's attention has it), the output
        projection, then the MLP's (gate, up, down; or up, down), a mixture's as wide as the top_k experts
        and the shared MLP a token runs (its router left out: hidden x experts)."""
        d, kv = self.hidden, self.hidden // self.heads * self.kv_heads
        attention = (d * d + 2 * d * kv,) if fused_qkv else (d * d, d * kv, d * kv)
        return attention + (d * d,) + (d * self.mlp_width,) * self.mlp_matrices

    @property
    def mlp_width(self) -> int:
        """The MLP hidden units one token runs: ffn, or top_k experts' and the shared MLP's."""
        return self.top_k * self.expert_ffn + self.shared_ffn if self.experts else self.ffn

    @property
    def tensors_per_block(self) -> int:
        return len(self.block)

    @functools.cached_property
    def parameters(self) -> int:
        return sum(n for _, n, _ in self.tensors())

    @functools.cached_property
    def expert_parameters(self) -> int:
        """The routed experts' parameters, every block's."""
        return sum(n for where, n, _ in self.tensors() if where == "expert")

    @functools.cached_property
    def active_parameters(self) -> int:
        """The parameters one token meets: every one of a dense model; of a mixture's experts, top_k."""
        return self.parameters - (
            self.expert_parameters // self.experts * (self.experts - self.top_k) if self.experts else 0
        )

    def expert_flops_per_token(self) -> float:
        """The routed experts' share of 6N: forward and backward through top_k experts in every block."""
        return 6 * self.layers * self.top_k * self.mlp_matrices * self.hidden * self.expert_ffn

    def flops_per_token(self, seq: int) -> float:
        """6N + 12·L·d·s, N the active parameters without the embedding lookup (as GPT.flops_per_token)."""
        n = self.active_parameters - (0 if self.tied else self.vocab * self.hidden)
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
    "mixtral-8x7b": ModelShape(32, 4096, 32, 8, 14336, 32000, experts=8, top_k=2, expert_ffn=14336),
}
