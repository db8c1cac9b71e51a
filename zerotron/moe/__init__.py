"""Mixture of experts (issue 31, in progress): gating.py, which experts each token goes to (DeepSpeed-MoE's
top-1 / top-2 / top-k gating with capacity, as a route table)."""

from .gating import Routes, dense, route, top1gating, top2gating, topkgating

__all__ = ["Routes", "dense", "route", "top1gating", "top2gating", "topkgating"]
