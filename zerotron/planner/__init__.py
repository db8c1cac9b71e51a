"""The planner: what fits and how fast it runs (issue 8; the model-state memory model so far)."""
from .memory import ModelShape, model_state_bytes

__all__ = ["ModelShape", "model_state_bytes"]
