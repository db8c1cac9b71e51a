"""`deepspeed.moe`: the helpers scripts call on parameter groups (utils); no MoE layer (layer)."""

from . import layer, utils  # noqa: F401
