"""Model parallelism: tensor parallelism (Megatron-style, applied by a plan)."""
