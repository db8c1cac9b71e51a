"""`deepspeed.utils.nvtx`: a decorator that marks a function as an NVTX range on CUDA (for Nsight)."""

import functools

import torch


def instrument_w_nvtx(func):
    """`func` inside a range named after it when CUDA is available; unchanged otherwise."""
    if not torch.cuda.is_available():
        return func

    @functools.wraps(func)
    def wrapped(*args, **kwargs):
        torch.cuda.nvtx.range_push(func.__qualname__)
        try:
            return func(*args, **kwargs)
        finally:
            torch.cuda.nvtx.range_pop()

    return wrapped
