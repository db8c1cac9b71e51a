"""Hugging Face causal LMs as pipelines: the decoder layers split into stages, the embeddings on the
first stage, the final norm and head on the last, tied input/output embeddings shared between them.

Covers the Llama family (Llama, Mistral, Qwen2, ...: model.embed_tokens / layers / norm /
rotary_emb) and GPT-2 (transformer.wte / wpe / h / ln_f). The pipeline's layers are the model's own
modules, and checkpoints keep the model's parameter names (PipelineModule.source_names).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..pipe import LayerSpec, PipelineModule, TiedLayerSpec


def _positions(h):
    return torch.arange(h.shape[1], device=h.device).unsqueeze(0)


class _Embed(nn.Module):
    """Token (and, for GPT-2, position) embeddings; `head`: the tied output projection."""

    def __init__(self, tokens, positions=None, head=None, dropout=None):
        super().__init__()
        self.tokens, self.positions, self.head, self.dropout = tokens, positions, head, dropout

    def forward(self, ids):
        h = self.tokens(ids)
        if self.positions is not None:
            h = h + self.positions(_positions(h))
        return h if self.dropout is None else self.dropout(h)

    @staticmethod
    def project(module, h):
        return module.head(h)


class _Decoder(nn.Module):
    """One decoder layer with one input: positions (and rotary tables) derived from the length; the
    causal mask comes from scaled_dot_product_attention (no padding masks in pipelines)."""

    def __init__(self, layer, rotary=None):
        super().__init__()
        self.layer, self.rotary = layer, rotary  # the rotary module is shared and has no parameters

    def forward(self, h):
        if self.rotary is None:  # GPT-2 block
            out = self.layer(h)
        else:
            pos = _positions(h)
            out = self.layer(h, attention_mask=None, position_ids=pos, position_embeddings=self.rotary(h, pos))
        return out[0] if isinstance(out, tuple) else out


class _Final(nn.Module):
    def __init__(self, norm, head=None):
        super().__init__()
        self.norm, self.head = norm, head

    def forward(self, h):
        h = self.norm(h)
        return h if self.head is None else self.head(h)


def to_pipeline(model, num_stages: int, partition_method: str = "type:_Decoder", **kwargs) -> PipelineModule:
    """`model` (a Transformers causal LM) as a zerotron PipelineModule; kwargs go to PipelineModule.
    Batches are (input_ids, labels) with labels as Transformers takes them (shifted inside the loss)."""
    from .hf import prepare_tensor_parallel, tensor_parallel_plan

    cfg = model.config
    if getattr(cfg, "_attn_implementation", "sdpa") == "eager":
        cfg._attn_implementation = "sdpa"  # the causal mask must come from the attention kernel
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    if hasattr(model, "transformer") and hasattr(model.transformer, "wte"):  # GPT-2
        base, tokens, positions, dropout = (
            model.transformer,
            model.transformer.wte,
            model.transformer.wpe,
            model.transformer.drop,
        )
        layers, norm, rotary = base.h, base.ln_f, None
    elif hasattr(model, "model") and hasattr(model.model, "embed_tokens"):  # Llama family
        base, tokens, positions, dropout = model.model, model.model.embed_tokens, None, None
        layers, norm, rotary = base.layers, base.norm, base.rotary_emb
    else:
        raise ValueError(
            f"{type(model).__name__}: zerotron pipelines Llama-family and GPT-2 causal LMs; "
            "write a PipelineModule of its layers for other architectures"
        )
    embed = _Embed(tokens, positions, model.lm_head if tied else None, dropout)
    embedding_name = next(n for n, m in model.named_modules() if m is tokens)
    decoders = [LayerSpec(_Decoder, layer, rotary) for layer in layers]
    if tied:
        first = TiedLayerSpec("embed", lambda: embed, tied_weight_attr="tokens.weight")
        last = [
            LayerSpec(_Final, norm),
            TiedLayerSpec("embed", lambda: embed, forward_fn=_Embed.project, tied_weight_attr="tokens.weight"),
        ]
    else:
        first = LayerSpec(lambda: embed)
        last = [LayerSpec(_Final, norm, model.lm_head)]

    def loss_fn(logits, labels):
        return model.loss_function(logits, labels, vocab_size=cfg.vocab_size)

    def plan(tp):
        # The model's plan, with names as they are inside the pipeline's layers.
        prepare_tensor_parallel(model, tp)
        out = {}
        for pattern, style in tensor_parallel_plan(model, tp).items():
            if pattern == embedding_name:
                out["*.tokens"] = style
            elif pattern == "lm_head":
                out["*.head"] = style
            else:
                out["*." + pattern.split(".*.", 1)[-1]] = style
        return out

    return PipelineModule(
        [first, *decoders, *last],
        num_stages=num_stages,
        loss_fn=loss_fn,
        partition_method=partition_method,
        tensor_parallel_plan=plan,
        source_module=model,
        **kwargs,
    )
