"""Mixture of experts (issue 31, in progress): gating.py, which experts each token goes to (DeepSpeed-MoE's
top-1 / top-2 / top-k gating with capacity, as a route table); layer.py, DeepSpeed's MoE layer (every
expert on every rank for now)."""

from .gating import Routes, dense, route, top1gating, top2gating, topkgating
from .layer import MoE, TopKGate

__all__ = ["MoE", "Routes", "TopKGate", "dense", "route", "top1gating", "top2gating", "topkgating"]
