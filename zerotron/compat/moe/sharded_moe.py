"""`deepspeed.moe.sharded_moe`: the gate and the gating functions (zerotron/moe/gating.py, layer.py)."""

from ...moe.gating import top1gating, top2gating, topkgating
from ...moe.layer import TopKGate

__all__ = ["TopKGate", "top1gating", "top2gating", "topkgating"]
