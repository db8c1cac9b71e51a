"""DeepSpeed's `"ignore_unused_parameters": false` at ZeRO stages 1-2: a step whose accumulation window gave some
trainable parameter no gradient is refused, naming the parameters, where the default (true) trains them with zero
gradients. DeepSpeed asserts at the step too (its gradient-norm pass finds no gradient for them)."""

from __future__ import annotations

import torch

from ..errors import MisuseError


class UnusedParameters:
    """Records which of `params` receive a gradient between two steps; `verify()` at the step raises for the
    others. Each rank judges its own backward, as DeepSpeed's check does."""

    def __init__(self, module: torch.nn.Module, params: list[torch.nn.Parameter]):
        names = {id(p): n for n, p in module.named_parameters()}
        self.expected = {id(p): names.get(id(p), f"<parameter of shape {tuple(p.shape)}>") for p in params}
        self.received: set[int] = set()
        self.hooks = [p.register_post_accumulate_grad_hook(self._received) for p in params]

    def _received(self, param: torch.Tensor) -> None:
        self.received.add(id(param))

    def verify(self) -> None:
        missing = [name for i, name in self.expected.items() if i not in self.received]
        self.received.clear()
        if missing:
            shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
            raise MisuseError(
                f"these parameters were not used in producing the loss (no gradient since the last step), and "
                f"zero_optimization.ignore_unused_parameters is false: {shown}. Set ignore_unused_parameters to "
                "true (the default: they train with zero gradients), set requires_grad=False on them, or make "
                "every trainable parameter take part in the loss"
            )


def unused_parameter_check(module: torch.nn.Module, config) -> UnusedParameters | None:
    """The check `"ignore_unused_parameters": false` asks for, at ZeRO stages 1-2 (where DeepSpeed makes it), over
    the module's trainable parameters; None elsewhere (config.py warns that it is not checked there)."""
    zero = config.zero_optimization
    if zero.stage in (1, 2) and not zero.ignore_unused_parameters:
        return UnusedParameters(module, [p for p in module.parameters() if p.requires_grad])
    return None
