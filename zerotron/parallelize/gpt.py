"""zerotron's reference GPT (models/gpt.py), parallelized from outside: its tensor-parallel plan
(Megatron's split) and its pipeline form (the same modules as one layer each)."""

from __future__ import annotations

import torch.nn as nn

from ..errors import ConfigError
from ..models.gpt import GPT, Block, GPTConfig, rotary_tables
from ..pipe import LayerSpec, PipelineModule, TiedLayerSpec


# ---- the pipeline form's layers (one input, one output each) ---------------------------------
class _Embedding(nn.Module):
    def __init__(self, tok_emb: nn.Embedding, lm_head: nn.Linear | None):
        super().__init__()
        self.tok_emb, self.lm_head = tok_emb, lm_head  # lm_head: the tied head, used by the last stage

    def forward(self, tokens):
        return self.tok_emb(tokens)

    @staticmethod
    def project(module, x):
        return module.lm_head(x)


class _PipeBlock(nn.Module):
    def __init__(self, block: "Block", cfg: GPTConfig):
        super().__init__()
        self.block, self.config = block, cfg

    def forward(self, x):
        cos, sin = rotary_tables(self.config, x.shape[1], x.device)
        return self.block(x, cos, sin)


class _Norm(nn.Module):
    def __init__(self, norm: nn.Module):
        super().__init__()
        self.norm = norm

    def forward(self, x):
        return self.norm(x)


class _Head(_Norm):
    def __init__(self, norm: nn.Module, lm_head: nn.Linear):
        super().__init__(norm)
        self.lm_head = lm_head

    def forward(self, x):
        return self.lm_head(self.norm(x))


def gpt_plan(model: GPT, tp: int) -> dict[str, str]:
    """Megatron's split: q/k/v and gate/up by output (whole heads per rank), o and down by
    input, the vocabulary across ranks for the embedding, head and loss; attention and MLP are
    the regions tensor_parallel.tp_overlap_comm runs in two halves."""
    cfg = model.config
    for what, n in (
        ("attention heads", cfg.n_head),
        ("key/value heads", cfg.n_kv_head),
        ("vocabulary", cfg.vocab_size),
        ("MLP hidden size", cfg.ffn),
    ):
        if n % tp:
            raise ConfigError(
                "tensor_parallel.autotp_size",
                tp,
                f"the model's {what} ({n}) must be divisible by it; choose a size that divides it",
            )
    # Leading "*": the same plan fits the model and its pipeline form (names like "layers.3.block.attn.wq").
    return {
        "*tok_emb": "vocab",
        "*attn.wq": "column",
        "*attn.wk": "column",
        "*attn.wv": "column",
        "*attn.wo": "row",
        "*mlp.w1": "column",
        "*mlp.w3": "column",
        "*mlp.w2": "row",
        "*lm_head": "head",
        "*norm": "norm",
        "*attn": "region",
        "*mlp": "region",
    }


def gpt_pipeline(model: GPT, num_stages: int, partition_method: str = "parameters", **kwargs) -> PipelineModule:
    """This model as a zerotron.pipe.PipelineModule over the same modules (same weights):
    embedding, one layer per block, final norm, head. With tied embeddings the embedding is a
    TiedLayerSpec shared by the first and last stage. kwargs go to PipelineModule."""
    cfg = model.config
    if cfg.n_experts and cfg.aux_loss_coef:
        raise ConfigError(
            "pipeline.stages",
            num_stages,
            "the mixture-of-experts GPT's load-balancing loss sums over every block, which no pipeline stage "
            "sees: its pipeline form would train without it. Split the experts instead (expert_parallel, "
            "zerotron train --ep N), or build the model with aux_loss_coef=0",
        )
    embed = _Embedding(model.tok_emb, model.lm_head if cfg.tie_embeddings else None)
    blocks = [LayerSpec(_PipeBlock, block, cfg) for block in model.layers]
    if cfg.tie_embeddings:
        first = TiedLayerSpec("embed", lambda: embed, tied_weight_attr="tok_emb.weight")
        last = [
            LayerSpec(_Norm, model.norm),
            TiedLayerSpec("embed", lambda: embed, forward_fn=_Embedding.project, tied_weight_attr="tok_emb.weight"),
        ]
    else:
        first = LayerSpec(lambda: embed)
        last = [LayerSpec(_Head, model.norm, model.lm_head)]
    return PipelineModule(
        [first, *blocks, *last],
        num_stages=num_stages,
        loss_fn=model.loss_fn,
        partition_method=partition_method,
        tensor_parallel_plan=lambda tp: gpt_plan(model, tp),
        source_module=model,
        **kwargs,
    )


def gpt_split_sequence(model, topology, rank: int) -> None:
    """Sequence parallelism on the reference GPT: every attention core runs over the whole sequence
    (Ulysses' all-to-alls within the sp ranks around ring attention over the cp ranks), the rotary
    positions are those of this rank's tokens, and the loss is the whole sequence's mean on every
    sequence rank."""
    from ..long_context.layout import SequenceSplit
    from ..long_context.model import RingCore, SequenceMeanLoss, UlyssesCore
    from ..models.gpt import Attention

    cfg, sp, cp = model.config, topology.sp, topology.cp
    if cfg.n_head % sp or cfg.n_kv_head % sp:
        raise ConfigError(
            "sequence_parallel_size",
            sp,
            f"the GPT has {cfg.n_head} query and {cfg.n_kv_head} key/value heads and Ulysses gives each sequence "
            "rank whole heads: use a sequence_parallel_size that divides both (ring attention, "
            "zerotron.context_parallel_size, has no such limit)",
        )
    if cp > 1 and cfg.dropout > 0:
        raise ConfigError(
            "zerotron.context_parallel_size",
            cp,
            f"ring attention has no attention dropout: set dropout 0 (it is {cfg.dropout})",
        )
    for m in model.modules():
        if isinstance(m, Attention):
            core = RingCore(topology.group("cp")) if cp > 1 else m.core
            m.core = UlyssesCore(core, topology.group("sp")) if sp > 1 else core
    model.token_positions = SequenceSplit.of(topology, rank).positions
    model.loss_fn = SequenceMeanLoss(topology.group("seq"))
