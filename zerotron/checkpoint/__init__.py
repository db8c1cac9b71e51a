"""Checkpoints: sharded, topology-free, resumable and safe (see save.py, load.py, export.py)."""

from .files import CheckpointError

__all__ = ["CheckpointError"]
