"""`deepspeed.launcher` / `.runner`: the constants scripts and accelerate read. zerotron launches
with `torchrun` or `zerotron run`; DeepSpeed's `deepspeed` launcher command is not provided."""

from __future__ import annotations

DEEPSPEED_ENVIRONMENT_NAME = ".deepspeed_env"  # DeepSpeed's file of environment variables to export
PDSH_LAUNCHER, PDSH_MAX_FAN_OUT = "pdsh", 1024
OPENMPI_LAUNCHER, MPICH_LAUNCHER, SLURM_LAUNCHER = "openmpi", "mpich", "slurm"
EXPORT_ENVS = ["MLFLOW", "PYTHON", "MV2", "UCX"]


def main(args=None):
    raise NotImplementedError(
        "DeepSpeed's launcher is not part of zerotron: launch with `torchrun` or `zerotron run -n N "
        "script.py` (ZEROTRON_AS_DEEPSPEED=1 for scripts that import deepspeed)"
    )
