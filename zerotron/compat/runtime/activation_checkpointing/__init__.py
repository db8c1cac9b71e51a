"""`deepspeed.runtime.activation_checkpointing`: `checkpointing` is zerotron.checkpointing itself
(one module object, so its configure() settings are the engine's)."""

import sys

from .... import activation_checkpointing as checkpointing

sys.modules[__name__ + ".checkpointing"] = checkpointing

__all__ = ["checkpointing"]
