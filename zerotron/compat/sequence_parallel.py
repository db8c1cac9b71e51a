"""`deepspeed.runtime.sequence_parallel` / `.ulysses_sp`: ALST, DeepSpeed's Ulysses for Transformers models
(accelerate's `parallelism_config.sp_backend="deepspeed"`), is not implemented yet; the names exist so
imports succeed and using them says so. DeepSpeed's own Ulysses API works: `parallel_state_sp`
(zerotron/compat/parallel_state_sp.py) and `deepspeed.sequence.layer.DistributedAttention`."""

from __future__ import annotations

_WHY = (
    "ALST, DeepSpeed's Ulysses sequence parallelism for Transformers models (ulysses_sp), is not implemented by "
    "zerotron yet: train without it (sp_size 1), write the model's attention with "
    "deepspeed.sequence.layer.DistributedAttention and set sequence_parallel_size, or use zerotron's "
    "Megatron-style sequence parallelism with tensor parallelism in zerotron's own API "
    '("zerotron": {"sequence_parallel": true})'
)


class _Refused:
    def __init__(self, *args, **kwargs):
        raise NotImplementedError(_WHY)

    @classmethod
    def register_with_transformers(cls, *args, **kwargs):
        raise NotImplementedError(_WHY)


class UlyssesSPAttentionHF(_Refused):
    """Refused (see the module)."""


class UlyssesSPDataLoaderAdapter(_Refused):
    """Refused (see the module)."""


class UlyssesSPFusedLogitsLoss(_Refused):
    """Refused (see the module)."""


class SequenceTiledCompute(_Refused):
    """Refused (see the module)."""


class TiledMLP(_Refused):
    """Refused (see the module)."""


__all__ = [
    "UlyssesSPAttentionHF",
    "UlyssesSPDataLoaderAdapter",
    "UlyssesSPFusedLogitsLoss",
    "SequenceTiledCompute",
    "TiledMLP",
]
