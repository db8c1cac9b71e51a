"""Mixture of experts (docs/moe.md): gating.py, which experts each token goes to (DeepSpeed-MoE's top-1 /
top-2 / top-k gating with capacity, as a route table); layer.py, DeepSpeed's MoE layer; exchange.py, the
tokens' trip to the ranks holding their experts and back; ep_groups.py and expert_groups.py, the
expert-parallel groups and what the engine and checkpoints need of them."""

from .gating import Routes, dense, route, top1gating, top2gating, topkgating
from .layer import MoE, TopKGate

__all__ = ["MoE", "Routes", "TopKGate", "dense", "route", "top1gating", "top2gating", "topkgating"]
