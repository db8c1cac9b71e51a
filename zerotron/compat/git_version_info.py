"""`deepspeed.git_version_info`: what this installation is, in the names DeepSpeed's tools and tests read.

`version` is zerotron's own; there are no compiled ops, so every op DeepSpeed lists is reported as not
installed (`installed_ops`: all False, as in a DeepSpeed installed without pre-built ops). `torch_info`
holds the running torch's version, CUDA and NCCL versions ("0.0" where there is none, DeepSpeed's sentinel).
"""

from __future__ import annotations

import sys

import torch

from .op_builder import ALL_OPS

# zerotron's own version, read from the package already imported (importing the package root from compat would be
# an import circle; a compat module is only ever imported below an imported zerotron)
version = sys.modules["zerotron"].__version__

git_hash = "[none]"
git_branch = "[none]"
installed_ops = dict.fromkeys(ALL_OPS, False)
accelerator_name = "cuda" if torch.cuda.is_available() else "cpu"


def _major_minor(text) -> str:
    return ".".join(str(text).split(".")[:2]) if text else "0.0"


def _nccl_version() -> str:
    try:
        return ".".join(map(str, torch.cuda.nccl.version()[:2])) if torch.cuda.is_available() else "0.0"
    except (AttributeError, RuntimeError):
        return "0.0"


torch_info = {
    "version": _major_minor(torch.__version__.split("+")[0]),
    "bf16_support": bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported()),
    "cuda_version": _major_minor(torch.version.cuda),
    "nccl_version": _nccl_version(),
    "hip_version": _major_minor(getattr(torch.version, "hip", None)),
}

__all__ = ["version", "git_hash", "git_branch", "installed_ops", "accelerator_name", "torch_info"]
