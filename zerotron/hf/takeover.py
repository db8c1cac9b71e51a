"""The Hugging Face Trainer's evaluate-then-train: `evaluate()` before `train()` builds an engine
without an optimizer, then training builds another on the same model. The model remembers the
engine that wraps it (`hold`), and a new engine first takes it back whole (`hand_back`)."""

from __future__ import annotations

import weakref

import torch
import torch.nn as nn

_KEY = "_zerotron_engine"  # in the model's __dict__, not an nn.Module attribute: no recursion


def hold(engine) -> None:
    """Remember on the model that `engine` wraps it."""
    engine.module.__dict__[_KEY] = _EngineHold(engine)


class _EngineHold:
    """What a model keeps of the engine that wraps it (the engine itself may be gone while its
    ZeRO-3 hooks stay on the model): enough to hand the model back whole (`hand_back`)."""

    def __init__(self, engine):
        self.states, self.grad_hooks = engine.states, engine.__dict__.get("_grad_hooks")
        self.engine = weakref.ref(engine)
        self.topology, self.device, self.config = engine.topology, engine.device, engine.config

    def engine_destroyed(self) -> bool:
        engine = self.engine()
        return engine is not None and getattr(engine, "_destroyed", False)

    def destroy(self):
        engine = self.engine()
        if engine is not None:
            engine.destroy()
            return
        if self.states is not None:
            self.states.destroy()
        for h in self.grad_hooks or []:
            h.remove()

    def __deepcopy__(self, memo):  # a copied model is not wrapped by this engine
        return None


@torch.no_grad()
def hand_back(module: nn.Module) -> None:
    """A model a live engine already wraps (the Trainer's evaluate() before train(), which builds
    an engine without an optimizer first, then the training one): the old engine hands the model
    back whole -- its ZeRO-3 units gathered to full parameters, its hooks removed -- and is
    destroyed, so the new one partitions it afresh. Every rank builds engines together, so the
    gathers line up. A tensor-parallel model is refused (its layers are already split)."""
    old = module.__dict__.get(_KEY)
    if old is None or old.engine_destroyed():
        return
    if old.topology.tp > 1:
        raise RuntimeError(
            "this model is already wrapped by a zerotron engine with tensor parallelism (its layers are "
            "split): build a new model for a second engine"
        )
    full = None
    if old.config.zero_optimization.stage == 3:
        from ..zero import consolidated_state_dict

        full = consolidated_state_dict(module)
    old.destroy()
    if full is not None:
        for name, t in list(module.named_parameters()) + list(module.named_buffers()):
            if name in full:
                t.data = full[name].to(old.device).clone()
            for attr in [a for a in vars(t) if a.startswith(("zt_", "ds_"))]:
                delattr(t, attr)
    module.__dict__.pop(_KEY, None)
