"""Optimizer kernels under DeepSpeed's `deepspeed.ops` names: `ops.adam` (FusedAdam, DeepSpeedCPUAdam),
`ops.adagrad` (DeepSpeedCPUAdagrad), `ops.lion` (FusedLion, DeepSpeedCPULion), `ops.lamb` (FusedLamb)."""

from . import adagrad, adam, lamb, lion  # noqa: E402,F401  (deepspeed.ops.adam & co. as attributes, as DeepSpeed)

# DeepSpeed's ops.adam & co. are packages, and scripts import below them (`deepspeed.ops.adam.fused_adam`); here each
# is one module. An empty __path__ makes the import system ask its finders for `zerotron.ops.adam.fused_adam`
# instead of refusing it as "not a package", so the rename way (`from zerotron.ops.adam.fused_adam import FusedAdam`)
# reaches the module paths.py maps it to, as the alias does.
for _module in (adagrad, adam, lamb, lion):
    _module.__path__ = []

# DeepSpeed's `deepspeed.ops.__compatible_ops__`: which of its op names work here. True for the optimizers above
# (Python on torch's kernels, nothing to compile); False for the ops scripts probe before using (NVMe async I/O)
# and for DeepSpeed's catch-all name. deepspeed.ops.op_builder's builders answer is_compatible() from this list.
__compatible_ops__ = {
    "cpu_adam": True,
    "cpu_adagrad": True,
    "cpu_lion": True,
    "fused_adam": True,
    "fused_lamb": True,
    "fused_lion": True,
    "async_io": False,
    "deepspeed_not_implemented": False,
}
