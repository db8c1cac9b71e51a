"""The planner: which layouts fit, and how fast they run (memory and step-time cost model,
hardware presets, the search behind `zerotron plan`)."""

from . import cost, hardware
from .activations import activation_bytes
from .cost import memory, step_time, throughput
from .hardware import Hardware
from .layout import Layout
from .memory import model_state_bytes, rank_state_bytes
from .model import ModelShape
from .search import deepspeed_config, plan

__all__ = [
    "ModelShape",
    "Hardware",
    "Layout",
    "model_state_bytes",
    "rank_state_bytes",
    "activation_bytes",
    "memory",
    "step_time",
    "throughput",
    "plan",
    "deepspeed_config",
    "cost",
    "hardware",
]
