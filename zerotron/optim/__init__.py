"""Optimizers: the config's "optimizer" section (DeepSpeed's names and parameters: build.py), and the
check that decides whether an optimizer may run on ZeRO's flat shards (shardable.py).

Config names, case-insensitive (DeepSpeed lower-cases its own names; torch's it takes as written,
zerotron takes them in any case):
- "Adam" / "AdamW": DeepSpeed's FusedAdam, decoupled weight decay unless `adam_w_mode` is false
  (for "Adam"). Built as torch.optim.AdamW/Adam(fused=True) (the same update bit for bit) or, with
  `bias_correction: false`, as zerotron.ops.adam.FusedAdam; with optimizer offload, CPUAdam.
- "Lion": zerotron.ops.lion.FusedLion (DeepSpeedCPULion with offload).
- "Adagrad": torch.optim.Adagrad (DeepSpeedCPUAdagrad with offload), as DeepSpeed builds them.
- "Lamb": zerotron.ops.lamb.FusedLamb; ZeRO stage 0 only (its trust ratio needs whole tensors).
- any other torch.optim class by name ("SGD", "RMSprop", "Adamax", "NAdam", ...), with its own
  parameter names, as DeepSpeed's getattr(torch.optim, type) does.
- "MuAdam" / "MuAdamW" / "MuSGD": from the `mup` package when it is installed.
Refused, with the reason and the fix: the 1-bit optimizers ("OneBitAdam", "ZeroOneAdam",
"OneBitLamb": compressed communication zerotron does not implement) and "Muon".
"""

from .build import build_optimizer, validate_optimizer
from .shardable import check_shardable, probe_elementwise

__all__ = ["build_optimizer", "validate_optimizer", "check_shardable", "probe_elementwise"]
