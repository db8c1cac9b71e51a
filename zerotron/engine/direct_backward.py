"""When a script's own `loss.backward()` (instead of engine.backward) is refused, as DeepSpeed refuses it."""

from __future__ import annotations

import torch

from ..errors import MisuseError


def functorch_transforming() -> bool:
    """True inside torch.func.grad / vmap / jacrev, whose backward passes are the transform's own, not a
    training backward (DeepSpeed lets them through too)."""
    peek = getattr(getattr(torch._C, "_functorch", None), "peek_interpreter_stack", None)
    return peek is not None and peek() is not None


def refuse_direct_backward(engine) -> None:
    """Raise where a direct `loss.backward()` cannot train as engine.backward would: with fp16, whose loss must be
    scaled first, and at ZeRO stage 0, where DeepSpeed 0.19.8 refuses it (its engine counts the gradients of a
    direct backward in its ZeRO optimizers only). A MisuseError: a RuntimeError, as DeepSpeed's."""
    if functorch_transforming():
        return
    if engine.loss_scaler.enabled:
        raise MisuseError(
            "with fp16 the loss must be scaled before backward: call engine.backward(loss) instead of loss.backward()"
        )
    if engine.zero_optimization_stage() == 0:
        raise MisuseError(
            "Direct calls to tensor.backward() are not supported at ZeRO stage 0 (as in DeepSpeed): call "
            "engine.backward(loss) instead of loss.backward(), or use zero_optimization.stage 1-3"
        )
