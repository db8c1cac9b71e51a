"""Optimizer kernels under DeepSpeed's `deepspeed.ops` names: `ops.adam` (FusedAdam, DeepSpeedCPUAdam),
`ops.adagrad` (DeepSpeedCPUAdagrad), `ops.lion` (FusedLion, DeepSpeedCPULion), `ops.lamb` (FusedLamb)."""

from . import adagrad, adam, lamb, lion  # noqa: E402,F401  (deepspeed.ops.adam & co. as attributes, as DeepSpeed)
