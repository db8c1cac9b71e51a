"""When a script's own `loss.backward()` (instead of engine.backward) is refused."""

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
    scaled first. (DeepSpeed 0.19.8 also refuses it at ZeRO stage 0, where its engine cannot see a direct backward;
    zerotron's can, at every stage.) A MisuseError: a RuntimeError, as DeepSpeed's."""
    if functorch_transforming():
        return
    if engine.loss_scaler.enabled:
        raise MisuseError(
            "with fp16 the loss must be scaled before backward: call engine.backward(loss) instead of loss.backward()"
        )
