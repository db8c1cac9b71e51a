"""`deepspeed.moe.layer`: zerotron has no Mixture-of-Experts layer or expert parallelism."""


class MoE:
    """DeepSpeed's MoE layer: not supported by zerotron, so constructing one is an error."""

    num_experts = 0

    def __init__(self, *args, **kwargs):
        raise NotImplementedError(
            "deepspeed.moe.layer.MoE is not supported by zerotron: it has no expert parallelism or gating "
            "kernels. Build the experts as ordinary modules (they train under data, tensor and pipeline "
            "parallelism and ZeRO like any other; see zerotron.compat.utils.set_z3_leaf_modules for ZeRO-3)"
        )


__all__ = ["MoE"]
