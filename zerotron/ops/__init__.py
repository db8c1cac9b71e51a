"""Optimizer kernels (DeepSpeed's `deepspeed.ops` names): `zerotron.ops.adam.DeepSpeedCPUAdam`."""
