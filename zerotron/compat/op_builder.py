"""`deepspeed.ops.op_builder`: DeepSpeed's op builders by name, for scripts and tests that ask which ops exist.

zerotron compiles nothing. The ops it has are Python optimizers over torch's kernels (zerotron/ops/), so a
builder answers `is_compatible()` True exactly for those (`zerotron.ops.__compatible_ops__`, the one list) and
False for every other op. `load()` never builds: for an op zerotron has, the error names the optimizer class to
use instead (DeepSpeed's own optimizer classes call `load()` internally; zerotron's don't need it); for the
rest it says the op does not exist here. A builder DeepSpeed has no class for on this platform resolves to
`NotImplementedBuilder`, as DeepSpeed's CPU accelerator does.
"""

from __future__ import annotations

from ..ops import __compatible_ops__

# DeepSpeed builder class -> op name; ops zerotron has not are served by NotImplementedBuilder's name.
_BUILDERS = {
    "CPUAdamBuilder": "cpu_adam",
    "CPUAdagradBuilder": "cpu_adagrad",
    "CPULionBuilder": "cpu_lion",
    "FusedAdamBuilder": "fused_adam",
    "FusedLambBuilder": "fused_lamb",
    "FusedLionBuilder": "fused_lion",
    "AsyncIOBuilder": "async_io",
    "GDSBuilder": "gds",
    "PinMemoryBuilder": "pin_memory",
    "QuantizerBuilder": "quantizer",
    "FPQuantizerBuilder": "fp_quantizer",
    "UtilsBuilder": "utils",
    "TransformerBuilder": "transformer",
    "StochasticTransformerBuilder": "stochastic_transformer",
    "InferenceBuilder": "transformer_inference",
    "InferenceCoreBuilder": "inference_core_ops",
    "InferenceCutlassBuilder": "cutlass_ops",
    "RaggedOpsBuilder": "ragged_device_ops",
    "RaggedUtilsBuilder": "ragged_ops",
    "RandomLTDBuilder": "random_ltd",
    "SpatialInferenceBuilder": "spatial_inference",
    "EvoformerAttnBuilder": "evoformer_attn",
    "FlashAttentionBuilder": "flash_attn",
    "CCLCommBuilder": "deepspeed_ccl_comm",
    "ShareMemCommBuilder": "deepspeed_shm_comm",
    "DeepCompileBuilder": "dc",
}
NOT_IMPLEMENTED = "deepspeed_not_implemented"
# zerotron's class for each op it has (what load()'s error points to)
_INSTEAD = {
    "cpu_adam": "zerotron.ops.adam.DeepSpeedCPUAdam",
    "cpu_adagrad": "zerotron.ops.adagrad.DeepSpeedCPUAdagrad",
    "cpu_lion": "zerotron.ops.lion.DeepSpeedCPULion",
    "fused_adam": "zerotron.ops.adam.FusedAdam",
    "fused_lamb": "zerotron.ops.lamb.FusedLamb",
    "fused_lion": "zerotron.ops.lion.FusedLion",
}


class OpBuilder:
    """DeepSpeed's builder interface, answering for zerotron: nothing is compiled or loaded."""

    NAME = NOT_IMPLEMENTED

    def __init__(self, name: str | None = None):
        self.name = name or self.NAME

    def absolute_name(self) -> str:
        return f"deepspeed.ops.{self.name}_op"

    def is_compatible(self, verbose: bool = False) -> bool:
        return bool(__compatible_ops__.get(self.NAME, False))

    def load(self, verbose: bool = True):
        instead = _INSTEAD.get(self.NAME)
        if instead is not None:
            raise RuntimeError(
                f"{type(self).__name__}().load(): zerotron compiles no ops; the {self.NAME!r} op is the Python "
                f"optimizer {instead} (on torch's kernels): construct that class instead of loading the op"
            )
        raise RuntimeError(
            f"{type(self).__name__}().load(): the op {self.NAME!r} does not exist in zerotron (it compiles no ops "
            f"and has no equivalent); check deepspeed.ops.__compatible_ops__[{self.NAME!r}] before using it"
        )

    @staticmethod
    def installed_rocm_version():
        return (0, 0)

    @staticmethod
    def installed_cuda_version(name=""):
        return (0, 0)


class NotImplementedBuilder(OpBuilder):
    NAME = NOT_IMPLEMENTED


def _builder(class_name: str, op: str) -> type:
    return type(class_name, (OpBuilder,), {"NAME": op if op in __compatible_ops__ else NOT_IMPLEMENTED})


for _name, _op in _BUILDERS.items():
    globals()[_name] = _builder(_name, _op)

# DeepSpeed's ALL_OPS: op name -> builder instance, for every op this platform answers for
ALL_OPS = {NOT_IMPLEMENTED: NotImplementedBuilder(), **{op: globals()[name]() for name, op in _BUILDERS.items()}}
ALL_OPS = {name: builder for name, builder in ALL_OPS.items() if builder.NAME == name}

__all__ = ["OpBuilder", "NotImplementedBuilder", "ALL_OPS", *_BUILDERS]
