"""Transformers models: their tensor-parallel plan (the one Transformers ships, translated to
zerotron's styles; GPT-2's written here) and the adjustments a split or activation checkpointing
needs. The registry in parallelize/registry.py dispatches here for every PreTrainedModel."""

from __future__ import annotations

import torch

# Transformers' tensor-parallel styles -> zerotron's (zerotron/tensor_parallel/tensor.py). A plan key names
# a module or a parameter; the same name then means the module's or the parameter's split.
_STYLES = {
    "colwise": "column",
    "rowwise": "row",
    "colwise_gather_output": "column_gathered",
    "colwise_rep": "column_gathered",
    "rowwise_split_input": "row_split_input",
    "rowwise_rep": "row_split_input",
    "embedding_rowwise": "vocab",
    "embedding_colwise": "embedding_column",
    "packed_colwise": "column_packed",
    "packed_rowwise": "row_packed",
    "replicated_with_grad_allreduce": "sum_grad",
    "sequence_parallel": "norm",
    "moe_tp_experts": "experts",
    "moe_identity_expert": "scale_input",
    "all_reduce": "reduce_output",
    "mla_kv_a_proj": "rope_tail",
    "local_params": "keep",
    "replicate": "keep",
}


def is_hf_model(module) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return isinstance(module, PreTrainedModel)


# GPT-2 ships no plan, and its attention projection is one fused q|k|v Conv1D: split it block by block.
_GPT2_PLAN = {
    "transformer.wte": "vocab",
    "transformer.h.*.attn.c_attn": "column_qkv",
    "transformer.h.*.attn.c_proj": "row",
    "transformer.h.*.mlp.c_fc": "column",
    "transformer.h.*.mlp.c_proj": "row",
    "lm_head": "column_gathered",
}


# OPT ships none either (DeepSpeedExamples' AutoTP + HF Trainer example trains facebook/opt-125m): Megatron's
# split of each decoder layer. The embedding stays whole, and with it the head tied to it.
_OPT_PLAN = {
    **{f"model.decoder.layers.*.self_attn.{p}": "column" for p in ("q_proj", "k_proj", "v_proj")},
    "model.decoder.layers.*.self_attn.out_proj": "row",
    "model.decoder.layers.*.fc1": "column",
    "model.decoder.layers.*.fc2": "row",
}
_PLANS = {"gpt2": _GPT2_PLAN, "opt": _OPT_PLAN}


def prepare_tensor_parallel(model, tp: int) -> None:
    """Model-specific adjustments before the split: GPT-2's attention splits its fused projection's
    output by a stored width, which becomes the local width; OPT's views its projections as
    (batch, -1, heads, head_dim), so the local head count must be stored or the sequence dimension
    would absorb the other ranks' heads."""
    model_type = getattr(model.config, "model_type", None)
    for m in model.modules():
        if model_type == "gpt2" and hasattr(m, "c_attn") and hasattr(m, "split_size"):
            m.split_size //= tp
            m.num_heads //= tp
        elif model_type == "opt" and hasattr(m, "q_proj") and hasattr(m, "num_heads"):
            m.num_heads //= tp


def prepare_checkpointing(model) -> None:
    """Activation checkpointing recomputes each layer in backward; a key/value cache would give the
    recomputation the forward's keys again (longer keys, other ops). Transformers' own
    gradient_checkpointing_enable turns the cache off for training too."""
    if getattr(model.config, "use_cache", False):
        model.config.use_cache = False


def use_sequence_parallel(model, group, ring_group) -> None:
    """Sequence parallelism for a Transformers model: its attention function runs under Ulysses
    over `group` (ALST) and/or as ring attention over `ring_group`, unless register_with_transformers
    already made it run over groups of those sizes (accelerate and the Trainer do, before the engine
    exists). Batches must come split: UlyssesSPDataLoaderAdapter or zerotron.long_context.shard_batch."""
    from ..comm import comm_for
    from ..long_context.hf_attention import wrap_attention, wrapped_groups

    implementation = model.config._attn_implementation
    current = wrapped_groups(implementation)

    def sizes(groups):
        return [1 if g is None else comm_for(g, name).size for g, name in zip(groups, ("sp", "cp"))]

    if current is None or sizes(current) != sizes((group, ring_group)):
        wrap_attention(model.config, implementation, group, ring_group=ring_group)


def tensor_parallel_plan(model, tp: int) -> dict[str, str]:
    """zerotron's plan from the model's own Transformers plan (names relative to `model`)."""
    shipped_by_us = _PLANS.get(getattr(model.config, "model_type", None))
    if shipped_by_us is not None:
        return _check_heads(model, tp, dict(shipped_by_us))
    plan = dict(getattr(model, "_tp_plan", None) or {})
    if not plan:
        base = getattr(model.config, "base_model_tp_plan", None) or {}
        prefix = getattr(model, "base_model_prefix", "")
        plan = {f"{prefix}.{k}" if prefix and hasattr(model, prefix) else k: v for k, v in base.items()}
    from ..errors import ConfigError

    if not plan:
        raise ConfigError(
            "tensor_parallel.autotp_size",
            tp,
            f"{type(model).__name__} ships no tensor-parallel plan "
            "(config.base_model_tp_plan): use 1, or give the model a tensor_parallel_plan(tp) method",
        )
    out = {}
    for pattern, style in plan.items():
        if style not in _STYLES:
            raise ConfigError(
                "tensor_parallel.autotp_size",
                tp,
                f"the model's plan splits {pattern} as {style!r}, "
                f"which zerotron does not translate (known: {', '.join(_STYLES)}): use 1",
            )
        out[pattern] = _STYLES[style]
    _keep_the_head_whole_where_needed(model, out)
    return _check_heads(model, tp, out)


def _keep_the_head_whole_where_needed(model, plan: dict) -> None:
    """The head's entry is an optimization, not a necessity: it is dropped (the head stays whole)
    when the head is tied to an input embedding the plan does not split, or when it is not a plain
    linear layer (its own forward, e.g. a learned logit scale, would see split logits)."""
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    if head is None:
        return
    names = {id(m): n for n, m in model.named_modules()}
    tied = embedding is not None and getattr(head, "weight", None) is getattr(embedding, "weight", False)
    if (tied and names.get(id(embedding)) not in plan) or type(head) is not torch.nn.Linear:
        plan.pop(names.get(id(head)), None)


def _check_heads(model, tp: int, out: dict) -> dict:
    cfg = model.config
    heads = getattr(cfg, "num_attention_heads", None) or getattr(cfg, "n_head", None)
    kv = getattr(cfg, "num_key_value_heads", None)
    from ..errors import ConfigError

    for what, n in (("attention heads", heads), ("key/value heads", kv), ("vocabulary", cfg.vocab_size)):
        if n is not None and n % tp:
            raise ConfigError(
                "tensor_parallel.autotp_size",
                tp,
                f"the model's {what} ({n}) must be divisible by it; choose a size that divides it",
            )
    return out
