"""Classes that `isinstance` answers for zerotron's engines: an optimizer (or the engine's ZeRO
state object) is an instance when a live engine with one of the given ZeRO stages drives it."""

from __future__ import annotations


class ZeroOptimizerMeta(type):
    def __instancecheck__(cls, obj):
        if type.__instancecheck__(cls, obj):
            return True
        from ...utils.engines import find_engine

        engine = find_engine(lambda e: obj is e.optimizer or obj is e.states)
        return engine is not None and engine.zero_optimization_stage() in cls._stages


def refuse(cls_name: str):
    raise TypeError(
        f"{cls_name} is DeepSpeed's ZeRO optimizer wrapper; zerotron builds its ZeRO state inside "
        "zerotron.initialize (engine.optimizer is the torch optimizer over the shards). Use "
        f"isinstance(engine.optimizer, {cls_name}) to ask which stage drives an optimizer"
    )
