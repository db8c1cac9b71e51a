"""`deepspeed.moe`: the MoE layer (layer), its gate and gating (sharded_moe, experts), and the helpers
scripts call on parameter groups (utils)."""

from ...moe import layer  # noqa: F401  (deepspeed.moe is zerotron.moe under the alias; this package holds the rest)
from . import experts, sharded_moe, utils  # noqa: F401
