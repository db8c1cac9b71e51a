"""How each kind of model is parallelized: one adapter per model family, found by class.

An adapter says how to split the model for tensor parallelism (a plan of module-name patterns ->
styles, see parallel/tensor.py), what to adjust before the split or under activation
checkpointing, how to call it for the plan probe, and how to cut it into pipeline stages. The
model itself stays plain code. zerotron's GPT and Transformers' PreTrainedModel are registered
here; a model of another class may carry a `tensor_parallel_plan(tp)` method of its own.
"""

from __future__ import annotations

from ..errors import ConfigError
from ..models.gpt import GPT
from ..pipe import PipelineModule
from . import gpt, hf, hf_pipeline


class Adapter:
    """The default: a model that brings its own `tensor_parallel_plan(tp)` (a PipelineModule, or
    a user's model); called as model(inputs, targets) -> loss."""

    def plan(self, model, tp: int, sequence_parallel: bool) -> dict[str, str]:
        if not hasattr(model, "tensor_parallel_plan"):
            raise ValueError(
                f"{type(model).__name__} has no tensor_parallel_plan(tp); tensor parallelism "
                "needs a plan (module-name patterns -> column/row/vocab/head/norm)"
            )
        return model.tensor_parallel_plan(tp)

    def prepare(self, model, tp: int) -> None:
        """Adjust the model just before its split."""

    def after_checkpointing(self, model) -> None:
        """Adjust the model once activation checkpointing wraps its blocks."""

    def use_split_head(self, model, head) -> None:
        """The plan split the head by vocabulary: the model computes its loss with `head.loss_fn`
        and returns logits through `head.output_fn` (zerotron's GPT and PipelineModule read them
        from their `loss_fn` / `output_fn` attributes)."""
        if not hasattr(model, "loss_fn"):
            raise ConfigError(
                "tensor-parallel plan",
                "head",
                f"{type(model).__name__} has no loss_fn attribute to "
                "take the vocabulary-parallel loss, so it would compute its loss on split logits: "
                "split its head with 'column_gathered' instead",
            )
        model.loss_fn, model.output_fn = head.loss_fn, head.output_fn

    def probe_call(self, model, ids):
        return model(ids[:, :-1], ids[:, 1:])

    def split_sequence(self, model, topology, rank: int) -> None:
        """Sequence parallelism: each rank holds part of every sequence (long_context/layout.py),
        and the model's attention must see the whole sequence. The default takes a model whose
        attention already goes through DistributedAttention (a DeepSpeed-Ulysses script) or that
        holds a Transformers model whose attention ALST registered (a wrapper around one); it
        refuses any other, whose attention would see only its slice, and ring attention, which
        needs an adapter that puts it in the model."""
        from ..long_context import DistributedAttention
        from ..long_context.hf_attention import wrapped_groups

        size = topology.sp
        if topology.cp > 1:
            raise ConfigError(
                "zerotron.context_parallel_size",
                topology.cp,
                f"ring attention is applied by a model's adapter and {type(model).__name__} has none that does "
                "(zerotron's GPT has): use Ulysses (sequence_parallel_size) or remove the key",
            )
        registered = any(  # a Transformers model inside, its attention registered with Ulysses (ALST)
            getattr(getattr(m, "config", None), "_attn_implementation", None) is not None
            and wrapped_groups(m.config._attn_implementation) is not None
            for m in model.modules()
        )
        if not registered and not any(isinstance(m, DistributedAttention) for m in model.modules()):
            raise ConfigError(
                "sequence_parallel_size",
                size,
                f"{type(model).__name__}'s attention does not go through DistributedAttention, so each rank "
                "would attend over its slice of the sequence only: write its attention with "
                "deepspeed.sequence.layer.DistributedAttention (zerotron.long_context), train zerotron's GPT "
                "or a Transformers model, or remove the key",
            )

    def pipeline(self, model, num_stages: int, **kwargs) -> PipelineModule:
        raise ValueError(
            f"{type(model).__name__}: zerotron has no pipeline form for it; build a PipelineModule of its layers"
        )


class GPTAdapter(Adapter):
    def plan(self, model, tp, sequence_parallel):
        return gpt.gpt_plan(model, tp)

    def pipeline(self, model, num_stages, **kwargs):
        return gpt.gpt_pipeline(model, num_stages, **kwargs)

    def split_sequence(self, model, topology, rank):
        gpt.gpt_split_sequence(model, topology, rank)


class TransformersAdapter(Adapter):
    def plan(self, model, tp, sequence_parallel):
        if sequence_parallel:
            raise ConfigError(
                "zerotron.sequence_parallel",
                True,
                "Transformers' tensor-parallel plans do not "
                "mark the sequence-split regions (norm gradients, position embeddings), so it "
                "would train wrong: turn it off for Transformers models",
            )
        if hasattr(model, "tensor_parallel_plan"):  # a model that brings its own
            return model.tensor_parallel_plan(tp)
        return hf.tensor_parallel_plan(model, tp)

    def prepare(self, model, tp):
        hf.prepare_tensor_parallel(model, tp)

    def after_checkpointing(self, model):
        hf.prepare_checkpointing(model)

    def probe_call(self, model, ids):
        return model(input_ids=ids, labels=ids).loss

    def pipeline(self, model, num_stages, **kwargs):
        return hf_pipeline.to_pipeline(model, num_stages, **kwargs)

    def split_sequence(self, model, topology, rank):
        hf.use_sequence_parallel(
            model, *(topology.group(d) if getattr(topology, d) > 1 else None for d in ("sp", "cp"))
        )


# Looked up along the model's class hierarchy; Transformers' class by name (it is optional).
REGISTRY: dict[object, Adapter] = {
    PipelineModule: Adapter(),
    GPT: GPTAdapter(),
    "transformers.modeling_utils.PreTrainedModel": TransformersAdapter(),
}


def register(cls, adapter: Adapter) -> None:
    """Teach zerotron another model family (a class, or "module.QualifiedName")."""
    REGISTRY[cls] = adapter


def adapter_for(model) -> Adapter:
    for klass in type(model).__mro__:
        found = REGISTRY.get(klass) or REGISTRY.get(f"{klass.__module__}.{klass.__qualname__}")
        if found is not None:
            return found
    return REGISTRY[PipelineModule]  # the default: the model's own plan


def to_pipeline(model, num_stages: int, **kwargs) -> PipelineModule:
    """`model` as a PipelineModule over the same modules (same weights); kwargs go to PipelineModule."""
    return adapter_for(model).pipeline(model, num_stages, **kwargs)


def tensor_parallel_plan(model, tp: int, sequence_parallel: bool = False) -> dict[str, str]:
    return adapter_for(model).plan(model, tp, sequence_parallel)
