"""`deepspeed.utils`: logging, RepeatingLoader, OnDevice, the process-group accessors (groups),
ZeRO-3 leaf modules, the safe_get/set_full_* functions and zero_to_fp32, over zerotron.

Functions that take no engine answer for the most recently initialized one (engines.py;
`register_engine(engine)` makes that explicit)."""

from ..runtime.dataloader import RepeatingLoader
from . import engines, groups, logging, module_utils, nvtx, tensor_fragment, zero_to_fp32  # noqa: F401

# (as in DeepSpeed, the attribute z3_leaf_module is the function; from-imports still reach the module)
from .engines import current_engine, register_engine
from .groups import *  # noqa: F401,F403  (DeepSpeed re-exports the public accessors here)
from .init_on_device import OnDevice
from .logging import log_dist, log_dist_once, logger, print_dist, set_log_level_from_string
from .nvtx import instrument_w_nvtx
from .tensor_fragment import (
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_full_optimizer_state,
    safe_get_local_fp32_param,
    safe_get_local_grad,
    safe_get_local_optimizer_state,
    safe_set_full_fp32_param,
    safe_set_full_grad,
    safe_set_full_optimizer_state,
    safe_set_local_fp32_param,
    safe_set_local_grad,
    safe_set_local_optimizer_state,
    safe_update_full_grad_vectorized,
)
from .z3_leaf_module import (
    get_z3_leaf_modules,
    set_z3_leaf_module,
    set_z3_leaf_modules,
    set_z3_leaf_modules_by_name,
    set_z3_leaf_modules_by_suffix,
    unset_z3_leaf_modules,
    z3_leaf_module,
    z3_leaf_parameter,
)
