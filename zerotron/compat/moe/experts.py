"""`deepspeed.moe.experts`: the experts' container (zerotron/moe/layer.py)."""

from ...moe.layer import Experts

__all__ = ["Experts"]
