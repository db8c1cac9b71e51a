"""The planner: what fits and how fast it runs (issue 8; so far: model-state and activation memory)."""
from .activations import activation_bytes
from .memory import ModelShape, model_state_bytes

__all__ = ["ModelShape", "model_state_bytes", "activation_bytes"]
