"""`deepspeed.runtime.sequence_parallel` / `.ulysses_sp`: refused. DeepSpeed's Ulysses sequence
parallelism for Transformers (accelerate's `parallelism_config.sp_backend="deepspeed"`) is not
implemented by zerotron; the names exist so imports succeed and using them says so."""

from __future__ import annotations

_WHY = (
    "DeepSpeed's Ulysses sequence parallelism (deepspeed.runtime.sequence_parallel) is not implemented by "
    "zerotron: train without sequence parallelism (sp_size 1), or use zerotron's Megatron-style sequence "
    'parallelism with tensor parallelism in zerotron\'s own API ("zerotron": {"sequence_parallel": true})'
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
