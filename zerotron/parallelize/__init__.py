"""Parallelism applied to a plain model from outside, in one step (torchtitan's parallelize_llama
is the model): Ulysses sequence parallelism as the registry's adapter applies it, tensor parallelism
from the plan the registry finds for the model's class (checked against the unsplit model first),
then the activation-checkpoint policy. The ZeRO strategy, which
needs the optimizer, comes after, in the engine (zero.make_model_states)."""

from __future__ import annotations

import contextlib

from .registry import REGISTRY, Adapter, adapter_for, register, tensor_parallel_plan, to_pipeline

__all__ = [
    "parallelize",
    "REGISTRY",
    "Adapter",
    "adapter_for",
    "register",
    "tensor_parallel_plan",
    "to_pipeline",
    "vocab_size",
]


def parallelize(module, config, topology, tp_comm, device) -> None:
    """Split `module` over the tensor-parallel ranks (when `topology.tp` > 1) where it was built,
    then move it to `device`, so only this rank's shards ever reach the device; apply the
    configured activation-checkpoint policy. In place."""
    adapter = adapter_for(module)
    if topology.seq > 1:  # Ulysses and/or ring attention: attention over the whole sequence
        import torch.distributed as dist

        adapter.split_sequence(module, topology, dist.get_rank())
    if topology.tp > 1:
        from ..tensor_parallel.tensor import apply_tensor_parallel

        sequence_parallel = config.zerotron.sequence_parallel
        plan = adapter.plan(module, topology.tp, sequence_parallel)
        with _plan_probe(module, adapter, config, tp_comm, topology.tp):  # records the whole model first
            adapter.prepare(module, topology.tp)
            head = apply_tensor_parallel(
                module, plan, tp_comm, sequence_parallel, overlap=config.tensor_parallel.tp_overlap_comm
            )
            if head is not None:  # before the probe runs the split model
                adapter.use_split_head(module, head)
            module.to(device)  # the probe then runs the split model there, with its collectives
    from .. import activation_checkpointing as checkpointing

    checkpointing.reset()
    checkpointing.configure(deepspeed_config=config, tp_comm=tp_comm)
    z = config.zerotron
    if checkpointing.apply_policy(module, z.checkpoint_policy, z.checkpoint_every):
        adapter.after_checkpointing(module)


def vocab_size(module) -> int | None:
    """The vocabulary size the model declares (zerotron's GPT and Transformers models: config.vocab_size)."""
    v = getattr(getattr(module, "config", None), "vocab_size", None)
    return v if isinstance(v, int) and v > 0 else None


def _plan_probe(module, adapter, config, tp_comm, tp: int):
    """Refuse a plan that changes what the model computes (parallel/probe.py): on by default,
    `zerotron.check_tensor_parallel_plan: false` skips it."""
    vocab = vocab_size(module)
    if not config.zerotron.check_tensor_parallel_plan or vocab is None:  # (pipeline stages: no vocab)
        return contextlib.nullcontext()
    from ..tensor_parallel.probe import PlanProbe

    return PlanProbe(module, adapter.probe_call, tp_comm, vocab, tokens=2 * tp + 1)
