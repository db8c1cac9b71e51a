"""`deepspeed.ops.transformer` (also `deepspeed.DeepSpeedTransformerLayer` / `DeepSpeedTransformerConfig`): DeepSpeed's
fused transformer layer is a compiled CUDA kernel (its TransformerBuilder op), which zerotron does not have. The
names import, so a script that only names them runs (BingBertSquad imports them under --deepspeed_transformer_kernel);
the config holds its values, as DeepSpeed's does; building a layer is refused by name with what to do instead."""

from __future__ import annotations

import torch.nn as nn

# DeepSpeedTransformerConfig's keywords and their defaults in DeepSpeed 0.19.8 (the values are only held here)
_DEFAULTS = {
    "batch_size": -1,
    "hidden_size": -1,
    "intermediate_size": -1,
    "heads": -1,
    "attn_dropout_ratio": -1,
    "hidden_dropout_ratio": -1,
    "num_hidden_layers": -1,
    "initializer_range": -1,
    "layer_norm_eps": 1e-12,
    "local_rank": -1,
    "seed": -1,
    "fp16": False,
    "pre_layer_norm": True,
    "normalize_invertible": False,
    "gelu_checkpoint": False,
    "adjust_init_range": True,
    "attn_dropout_checkpoint": False,
    "stochastic_mode": False,
    "return_tuple": False,
    "training": True,
}


class DeepSpeedTransformerConfig:
    """The settings of DeepSpeed's fused layer, held as attributes (nothing here uses them)."""

    def __init__(self, **kwargs):
        unknown = sorted(set(kwargs) - set(_DEFAULTS))
        if unknown:
            raise TypeError(f"DeepSpeedTransformerConfig got unexpected keyword arguments {unknown}")
        for key, default in _DEFAULTS.items():
            setattr(self, key, kwargs.get(key, default))


class DeepSpeedTransformerLayer(nn.Module):
    """Refused when built: see the module docstring."""

    def __init__(self, config=None, initial_weights=None, initial_biases=None):
        raise NotImplementedError(
            "DeepSpeedTransformerLayer is DeepSpeed's fused CUDA transformer kernel (its TransformerBuilder op), "
            "which zerotron does not have (it compiles no kernels): build the model with its own transformer layers "
            "(BingBertSquad: run without --deepspeed_transformer_kernel); the trained model is the same"
        )


__all__ = ["DeepSpeedTransformerConfig", "DeepSpeedTransformerLayer"]
