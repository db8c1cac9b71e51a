"""`deepspeed.init_inference` (and `deepspeed.inference`): DeepSpeed-Inference, its kernel injection and inference
tensor parallelism, is not part of zerotron, a training engine. The name exists so that a script naming it gets
the reason and what to do instead rather than a bare missing attribute (DeepSpeedExamples' inference scripts and
the evaluation paths of some training scripts, e.g. MoQ's, call it)."""

from __future__ import annotations


def init_inference(model=None, config=None, **kwargs):
    raise NotImplementedError(
        "deepspeed.init_inference (DeepSpeed-Inference: injected CUDA kernels, inference tensor parallelism) is not "
        "part of zerotron, which trains: run the trained model's own forward or generate() under torch.no_grad() "
        "(an engine's module after zerotron.zero.consolidated_state_dict for ZeRO-3), or serve it with an "
        "inference engine"
    )
