"""Megatron-style tensor parallelism, applied to a plain model afterwards by a plan.

A plan maps name patterns (fnmatch over module names, or over parameter names for the
parameter styles) to a style. Linear layers are replaced by their parallel versions
(zerotron/tensor_parallel/layers.py); every other style keeps the module as it is (its class, its
forward, its parameter names) and adds hooks around it.

Linear layers (nn.Linear, or Transformers' Conv1D, whose weight is stored transposed):
    "column"          output features split; the input is copied in (all-reduced in backward)
    "column_qkv"      a fused q|k|v projection as "column", each of its 3 blocks split separately
    "column_packed"   a fused gate|up projection, each of its 2 blocks split separately
    "column_gathered" "column" with the outputs gathered whole (for layers read replicated, e.g. the
                      head of a model that computes its loss itself)
    "head"            the output projection as "column", its logits left split, and the model's
                      loss replaced by a vocabulary-parallel cross-entropy that never gathers them
    "row"             input features split; the outputs all-reduced, the bias added once
    "row_split_input" "row" for an input that arrives whole: each rank takes its slice first
Embeddings:
    "vocab"           rows (the vocabulary) split: each rank looks up its own, outputs summed
    "embedding_column" the embedding dimension split, outputs gathered
Other modules:
    "norm"            a norm in the sequence-parallel region (matters only with sequence parallelism)
    "sum_grad"        replicated parameters that see only this rank's part (per-head norms over the
                      local heads): their gradients are summed over the group
    "experts"         a mixture-of-experts block whose expert weights are split by parameter entries:
                      inputs and routing weights copied in, the outputs summed
    "reduce_output"   a module whose outputs are partial sums on each rank: all-reduced
    "rope_tail"       multi-head latent attention's shared key projection: the last
                      `qk_rope_head_dim` outputs feed only this rank's heads, so their gradient is summed
    "scale_input"     the input divided by the group size (an identity expert inside "experts")
    "region"          an attention or MLP block between one entry and one exit: with
                      tensor_parallel.tp_overlap_comm it runs its batch in two halves, one half's
                      collective in flight while the other computes (parallel/overlap.py)
    "keep"            nothing to do (the module's own parameter entries say how they are split)
Parameters (an entry naming a parameter instead of a module):
    "column" / "column_packed"  split along the output features (dim -2; dim 0 of a vector)
    "row" / "row_packed"        split along the input features (dim -1; a vector stays whole)

Every rank must start from the same full weights (same seed); each keeps only its slice. A
parameter that is split must be used only by modules a style prepared for it: anything else is an
error naming the module, never a silently wrong result.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from ..comm import Comm
from ..errors import ConfigError
from .collectives import copy_to_region, gather_last_dim, reduce_from_region
from .layers import (
    ColumnParallelLinear,
    Region,
    RowParallelLinear,
    VocabParallelLoss,
    check_divisible,
    shard_parameter,
    sum_grad_over,
    transposed,
)

MODULE_STYLES = (
    "column",
    "column_qkv",
    "column_packed",
    "column_gathered",
    "head",
    "row",
    "row_split_input",
    "vocab",
    "embedding_column",
    "norm",
    "sum_grad",
    "experts",
    "reduce_output",
    "rope_tail",
    "scale_input",
    "region",
    "keep",
)
PARAMETER_STYLES = {"column": (-2, 1), "column_packed": (-2, 2), "row": (-1, 1), "row_packed": (-1, 2)}


@dataclass
class SplitHead:
    """What a model whose head the plan split by vocabulary ("head" style) must compute with: the
    loss over split logits, and the gather that makes returned logits whole."""

    loss_fn: Callable
    output_fn: Callable


class _Plan:
    """What applying one plan needs: the group, the shared region, the model; the split head."""

    def __init__(self, model: nn.Module, comm: Comm, sequence_parallel: bool):
        self.model, self.comm = model, comm
        self.region = Region(comm, sequence_parallel)
        self.prepared: set[int] = set()  # modules a style set up (they may hold split parameters)
        self.head: SplitHead | None = None
        self.regions: list[tuple[str, nn.Module]] = []  # "region" entries (overlapped once all are split)


def apply_tensor_parallel(
    model: nn.Module, plan: dict[str, str], comm: Comm, sequence_parallel: bool = False, overlap: bool = False
) -> SplitHead | None:
    """Apply `plan` to `model` in place (see the module docstring). When the plan splits the head
    by vocabulary, returns the loss and output functions the model must use from now on.
    `overlap` (tensor_parallel.tp_overlap_comm): the plan's regions run their batch in two halves."""
    known = dict.fromkeys(MODULE_STYLES + tuple(PARAMETER_STYLES))
    for pattern, style in plan.items():
        if style not in known:
            raise ConfigError("tensor-parallel plan", f"{pattern}: {style}", f"use one of {', '.join(known)}")
    ctx = _Plan(model, comm, sequence_parallel)
    matched = False
    for name, param in list(model.named_parameters()):
        style = _style_of(name, plan)
        if style is not None:
            _split_parameter(name, param, style, comm)
            matched = True
    for name, module in list(model.named_modules()):
        style = _style_of(name, plan)
        if style is None:
            continue
        matched = True
        new = _apply_style(name, module, style, ctx)
        ctx.prepared.add(id(new))
        if new is not module:
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, child, new)
    if not matched:
        raise ConfigError("tensor-parallel plan", sorted(plan), "no module or parameter name matches any pattern")
    _check_split_parameters_are_prepared(model, ctx)
    if overlap:
        from .overlap import split_batch

        if not ctx.regions:
            raise ConfigError(
                "tensor_parallel.tp_overlap_comm",
                True,
                "the model's tensor-parallel plan marks no "
                '"region" (an attention or MLP block) to run in two overlapped halves (the reference '
                "GPT's plan does); turn tp_overlap_comm off for this model",
            )
        for name, module in ctx.regions:
            split_batch(module, ctx.region, comm, name)
    for p in model.parameters():
        if not hasattr(p, "tp_split_dim"):
            p.tp_replicated = True  # counted once, not tp times, in the global gradient norm
    return ctx.head


def _style_of(name: str, plan: dict[str, str]) -> str | None:
    return next((s for pattern, s in plan.items() if fnmatch.fnmatchcase(name, pattern)), None)


def _split_parameter(name: str, param: nn.Parameter, style: str, comm: Comm):
    if style == "keep":
        return
    if style not in PARAMETER_STYLES:
        raise ConfigError(
            "tensor-parallel plan",
            f"{name}: {style}",
            f"a parameter entry takes one of {', '.join(PARAMETER_STYLES)} or keep",
        )
    dim, stride = PARAMETER_STYLES[style]
    if param.dim() == 1:  # a bias: split with the output features, whole with the input features
        if dim == -1:
            return
        dim = 0
    shard_parameter(param, dim, comm, stride)


def _apply_style(name: str, module: nn.Module, style: str, ctx: _Plan) -> nn.Module:
    comm, region = ctx.comm, ctx.region
    if style not in MODULE_STYLES:
        raise ConfigError(
            "tensor-parallel plan",
            f"{name}: {style}",
            f"'{style}' splits a parameter, and {name} is "
            f"a module ({type(module).__name__}); use one of {', '.join(MODULE_STYLES)}",
        )
    if style in ("column", "column_qkv", "column_packed", "column_gathered", "head"):
        stride = {"column_qkv": 3, "column_packed": 2}.get(style, 1)
        new = ColumnParallelLinear(
            _expect_linear(module, name, style), comm, region, gather_output=style == "column_gathered", stride=stride
        )
        if style == "head":  # training reads split logits; anything else gets them whole
            ctx.head = SplitHead(
                VocabParallelLoss(comm, new.weight.shape[0]), lambda logits, c=comm: gather_last_dim(logits, c)
            )
        return new
    if style in ("row", "row_split_input"):
        return RowParallelLinear(
            _expect_linear(module, name, style), comm, region, split_input=style == "row_split_input"
        )
    if style == "vocab":
        return _vocab_parallel(_expect(module, nn.Embedding, name, style), ctx)
    if style == "embedding_column":
        emb = _expect(module, nn.Embedding, name, style)
        shard_parameter(emb.weight, 1, comm)
        emb.register_forward_hook(lambda m, args, out: gather_last_dim(out, comm))
    elif style in ("norm", "sum_grad"):
        for p in module.parameters(recurse=False):
            sum_grad_over(p, region, only_when_split=style == "norm")
    elif style in ("experts", "reduce_output"):
        if style == "experts":
            module.register_forward_pre_hook(_experts_inputs(comm), with_kwargs=True)
        module.register_forward_hook(lambda m, args, out: reduce_from_region(out, comm))
        for child in module.modules():
            if child is not module:  # partial sums until this module adds them up
                child.tp_partial_output = True
            if style == "experts":  # its weights are split by parameter entries, used only here
                ctx.prepared.add(id(child))
    elif style == "rope_tail":
        module.register_forward_hook(_rope_tail(_rope_dim(ctx.model, name), comm))
    elif style == "region":
        ctx.regions.append((name, module))
    elif style == "scale_input":
        module.register_forward_pre_hook(lambda m, args: (args[0] / comm.size, *args[1:]))
        module.tp_partial_output = True
    return module


def _vocab_parallel(emb: nn.Embedding, ctx: _Plan) -> nn.Embedding:
    """Split the rows of `emb` and hook it: ids outside this rank's rows look up row 0 and are
    zeroed, the outputs are summed. The module keeps its class, so a subclass's own forward (an
    embedding that scales its output, say) still runs."""
    comm, region = ctx.comm, ctx.region
    check_divisible(emb.num_embeddings, comm.size, "vocabulary size")
    per_rank = emb.num_embeddings // comm.size
    start = comm.rank * per_rank
    shard_parameter(emb.weight, 0, comm)
    if emb.padding_idx is not None:  # the padding row keeps a zero gradient on the rank holding it
        local = emb.padding_idx - start
        emb.padding_idx = local if 0 <= local < per_rank else None
    emb.num_embeddings = per_rank
    outside = {}

    def before(module, args, kwargs):
        ids = args[0] if args else kwargs.pop("input")
        mask = (ids < start) | (ids >= start + per_rank)
        outside["mask"] = mask
        region.start(ids.shape[1] if ids.dim() > 1 else ids.shape[0])
        return ((ids - start).masked_fill(mask, 0), *args[1:]), kwargs

    def after(module, args, out):
        return region.exit(out.masked_fill(outside.pop("mask").unsqueeze(-1), 0.0))

    emb.register_forward_pre_hook(before, with_kwargs=True)
    emb.register_forward_hook(after)
    return emb


def _experts_inputs(comm: Comm):
    """hidden_states and the routing weights (positional or keyword, as Transformers' experts take
    them): copied in, so backward sums the partial gradients each rank's slice of every expert gives."""

    def hook(module, args, kwargs):
        args = list(args)
        for i, keys in ((0, ("hidden_states",)), (2, ("top_k_weights", "routing_weights"))):
            if i < len(args):
                args[i] = copy_to_region(args[i], comm)
            for key in keys:
                if key in kwargs:
                    kwargs[key] = copy_to_region(kwargs[key], comm)
        return tuple(args), kwargs

    return hook


def _rope_dim(model: nn.Module, name: str) -> int:
    cfg = getattr(model, "config", None)
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    dim = getattr(cfg, "qk_rope_head_dim", None)
    if not isinstance(dim, int):
        raise ConfigError("tensor-parallel plan", f"{name}: rope_tail", "the model's config has no qk_rope_head_dim")
    return dim


def _rope_tail(dim: int, comm: Comm):
    def hook(module, args, out):
        head, tail = out.split([out.shape[-1] - dim, dim], dim=-1)
        return torch.cat([head, copy_to_region(tail, comm)], dim=-1)

    return hook


def _check_split_parameters_are_prepared(model: nn.Module, ctx: _Plan):
    for name, module in model.named_modules():
        if id(module) in ctx.prepared:
            continue
        split = [n for n, p in module.named_parameters(recurse=False) if hasattr(p, "tp_split_dim")]
        if split:
            raise ConfigError(
                "tensor-parallel plan",
                name or "(root)",
                f"its parameter(s) {', '.join(split)} are split but no style prepares the module "
                "that uses them (a weight tied to a split one, or a parameter entry without an "
                "entry for its module): add one to the plan, or leave the parameter whole",
            )


def _expect_linear(module, name, style):
    """A linear layer the parallel versions can replace: nn.Linear or Conv1D itself, not a subclass
    with its own forward or parameters (they would be lost in the replacement)."""
    if transposed(module):
        return module
    _expect(module, nn.Linear, name, style)
    extra = sorted(set(dict(module.named_parameters())) - {"weight", "bias"})
    if type(module).forward is not nn.Linear.forward or extra:
        raise ConfigError(
            "tensor-parallel plan",
            f"{name}: {style}",
            f"{name} is a {type(module).__name__}, a linear layer with its own forward"
            f"{' and parameters ' + ', '.join(extra) if extra else ''}; '{style}' splits plain "
            "nn.Linear layers only: leave it out of the plan",
        )
    return module


def _expect(module, cls, name, style):
    if not isinstance(module, cls):
        raise ConfigError(
            "tensor-parallel plan",
            f"{name}: {style}",
            f"'{style}' applies to {cls.__name__} modules, and {name} is a {type(module).__name__}",
        )
    return module
