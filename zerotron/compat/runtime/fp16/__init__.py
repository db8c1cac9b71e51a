"""`deepspeed.runtime.fp16`: the loss scalers (loss_scaler.py)."""

from . import loss_scaler  # noqa: F401
