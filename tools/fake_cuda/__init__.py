"""Fake CUDA: one training step of any feature, on a CPU-only machine, with its tensors on torch's "cuda" device
under CUDA's rules (device placement, the CUDA kernels' shapes and layouts, CUDA-only kernels' constraints, host
syncs counted, NCCL's tensor rules). See session.py; tests/test_fake_cuda.py runs every feature through it."""

from .collectives import BACKEND
from .report import FakeCudaError, Sync
from .session import FakeCuda

__all__ = ["BACKEND", "FakeCuda", "FakeCudaError", "Sync"]
