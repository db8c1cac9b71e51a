"""DeepSpeed's checkpoint files are pickles: read them without DeepSpeed and without trusting them.

DeepSpeed's `torch.save`d dicts hold, besides tensors and plain data, a few DeepSpeed objects: the ZeRO
stage (`ZeroStageEnum`), the loss scaler, and the fragment addresses of its parameter mappings. `load`
reads a file with torch's weights-only unpickler, which refuses every global not on an allow-list, and
allows exactly those few, mapped to the plain stand-ins below, so DeepSpeed need not be installed and a
file naming any other class is refused with its name. `save` writes the stand-ins back under
DeepSpeed's names, so DeepSpeed reads what zerotron writes as its own objects.
"""

from __future__ import annotations

import argparse
import enum
import io
import pickle
from pathlib import Path

import torch

from .files import CheckpointError


class ZeroStageEnum(enum.IntEnum):
    """DeepSpeed's ZeRO stage enum (deepspeed.runtime.zero.config); an int, so `stage <= 2` works."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 4


class _Attributes:
    """An object that is only its attributes (what DeepSpeed's loss scalers and fragment addresses
    pickle): unpickling sets them, nothing runs."""

    def __init__(self, **attributes):
        self.__dict__.update(attributes)

    def __setstate__(self, state):
        self.__dict__.update(state)

    def __repr__(self):
        return f"{type(self).__name__}({self.__dict__})"


class LossScaler(_Attributes):
    """DeepSpeed's static loss scaler: cur_scale, dynamic."""


class DynamicLossScaler(_Attributes):
    """DeepSpeed's dynamic loss scaler: cur_scale, cur_iter, last_overflow_iter, scale_factor,
    scale_window, min_scale, delayed_shift, cur_hysteresis, consecutive_hysteresis, ..."""


class FragmentAddress(_Attributes):
    """DeepSpeed's fragment_address(numel, start) of a parameter in a flat partition."""


# DeepSpeed's name -> the stand-in (one table: what `load` allows is what `save` writes).
STAND_INS = {
    "deepspeed.runtime.zero.config.ZeroStageEnum": ZeroStageEnum,
    "deepspeed.runtime.fp16.loss_scaler.LossScaler": LossScaler,
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler": DynamicLossScaler,
    "deepspeed.utils.tensor_fragment.fragment_address": FragmentAddress,
    "argparse.Namespace": argparse.Namespace,  # Megatron-DeepSpeed's `args` in the model states
}
_DEEPSPEED_NAME = {cls: name for name, cls in STAND_INS.items()}


def load(path: Path) -> dict:
    """A DeepSpeed checkpoint file's contents, on the CPU, memory-mapped (tensors are read when sliced)."""
    try:
        with torch.serialization.safe_globals([(cls, name) for name, cls in STAND_INS.items()]):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"{path} pickles an object zerotron does not load ({_refused_global(e)}): it reads only tensors, "
            f"plain data and DeepSpeed's {', '.join(n.rsplit('.', 1)[1] for n in STAND_INS)}, so that a "
            "checkpoint cannot run code; a file not written by DeepSpeed's save_checkpoint?"
        ) from None
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: the DeepSpeed checkpoint is incomplete") from None
    except (RuntimeError, OSError, EOFError) as e:
        raise CheckpointError(f"{path} cannot be read as a DeepSpeed checkpoint file ({e}): it is damaged") from None


def _refused_global(error: Exception) -> str:
    text = str(error)
    marker = "Unsupported global: GLOBAL "
    if marker in text:
        return text.split(marker, 1)[1].split(" ", 1)[0].rstrip(".,:")
    return text.splitlines()[0] if text else type(error).__name__


class _DeepSpeedPickler(pickle._Pickler):
    """Writes the stand-ins' classes under DeepSpeed's names (pickle would refuse: it checks that the
    name imports to the same object, and DeepSpeed need not be installed)."""

    def save_global(self, obj, name=None):
        ds_name = _DEEPSPEED_NAME.get(obj)
        if ds_name is None or ds_name.startswith("argparse."):
            return super().save_global(obj, name)
        module, qualname = ds_name.rsplit(".", 1)
        self.write(pickle.GLOBAL + f"{module}\n{qualname}\n".encode())  # protocol 2, torch.save's default
        self.memoize(obj)


class _PickleModule:
    """What torch.save asks of its pickle_module."""

    __name__ = "pickle"
    Pickler = _DeepSpeedPickler
    Unpickler = pickle.Unpickler
    load = staticmethod(pickle.load)


def save(obj, path: Path):
    buffer = io.BytesIO()
    torch.save(obj, buffer, pickle_module=_PickleModule)
    Path(path).write_bytes(buffer.getvalue())
