"""initialize()'s side of autotuning: fill the batch sizes (and the ZeRO stage the config leaves open) from
the planner's prediction, or run the launcher's probe. See the package's docstring."""

from __future__ import annotations

import math
import os

from ..config import Config, is_auto, read_raw
from ..config.sections import enabled as enabled_in
from ..errors import ConfigError
from ..log import logger, warn
from ..planner.hardware import GIB, this_machine
from ..planner.model import ModelShape
from ..planner.tune import tune
from .model_info import dtype_of, install_probe, max_positions, model_shape

ENV_PROBE = "ZEROTRON_AUTOTUNING_PROBE"  # set by `zerotron run --autotuning`: record the model here and stop
ENV_TUNED = "ZEROTRON_AUTOTUNED"  # set by its tuned run: the config it hands the script is already tuned
BATCH = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")

# DeepSpeed's autotuning keys the prediction uses (and the launcher's: results_dir, exps_dir, overwrite,
# arg_mappings), and those that only steer its trial runs, which a prediction has none of.
USED = {
    "enabled",
    "metric",
    "arg_mappings",
    "results_dir",
    "exps_dir",
    "overwrite",
    "max_train_batch_size",
    "min_train_batch_size",
    "max_train_micro_batch_size_per_gpu",
    "min_train_micro_batch_size_per_gpu",
    "mp_size",
    "model_info",
}
TRIALS_ONLY = {
    "fast",
    "start_step",
    "end_step",
    "start_profile_step",
    "end_profile_step",
    "metric_path",
    "model_info_path",
    "tuner_type",
    "tuner_early_stopping",
    "tuner_num_trials",
    "num_tuning_micro_batch_sizes",
}


def _number(raw: dict, key: str) -> int | None:
    value = raw.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def check_section(section: dict) -> None:
    """Warn about the keys that steer trial runs (there are none to steer) and refuse keys DeepSpeed lacks."""
    unknown = sorted(set(section) - USED - TRIALS_ONLY)
    if unknown:
        raise ConfigError(
            f"autotuning.{unknown[0]}",
            section[unknown[0]],
            f"not an autotuning key; its keys: {', '.join(sorted(USED | TRIALS_ONLY))}",
        )
    trials = sorted(set(section) & TRIALS_ONLY)
    if trials:
        warn(
            "autotuning: zerotron's tuner predicts with the planner and runs no trials; these keys steer "
            f"DeepSpeed's trial runs and change nothing here: {', '.join(trials)} (remove them)"
        )


def resolve(config, model, world_size: int):
    """The config with the autotuning section applied (a new dict), or `config` itself when there is nothing
    to do: no section enabled and batch sizes given (or derivable, as the Trainer's "auto" values are)."""
    if isinstance(config, Config):
        return config
    raw = read_raw(config)
    section = raw.get("autotuning")
    enabled = enabled_in(section)
    if os.environ.get(ENV_PROBE):
        install_probe(model, raw, os.environ[ENV_PROBE], world_size)
        raw.pop("autotuning", None)
        for key in BATCH:  # the probe stops at the first forward: one sequence per rank will do
            if is_auto(raw.get(key)):
                del raw[key]
        if not any(_number(raw, k) for k in BATCH):
            raw["train_micro_batch_size_per_gpu"] = 1
        return raw
    batch_open = not any(_number(raw, k) for k in BATCH) and any(is_auto(raw.get(k)) for k in BATCH)
    if not enabled and not batch_open:
        return config
    if enabled:
        check_section(section)
    raw.pop("autotuning", None)
    if os.environ.get(ENV_TUNED):  # the launcher chose, and passed its choice in the config and the script's flags
        return raw
    section = section if enabled else {}
    shape = model_shape(model, section.get("model_info"))
    return choose(raw, shape, max_positions(model), dtype_of(raw, model), world_size, section, enabled)


def choose(
    raw: dict,
    shape: ModelShape,
    seq: int | None,
    dtype: str,
    world_size: int,
    section: dict,
    enabled: bool,
    keep_given: bool = True,
) -> dict:
    """Fill `raw`'s micro-batch and accumulation (and the ZeRO stage when it is open and tuning is enabled)
    with the planner's choice for sequences of `seq` tokens. With `keep_given`, a micro-batch the config (or
    the Trainer, from --per_device_train_batch_size) set is kept, and the log says what the planner would
    have chosen; the launcher tunes it whatever it was, as DeepSpeed's autotuner does."""
    if not seq:
        raise ConfigError(
            "train_micro_batch_size_per_gpu",
            "auto",
            "the planner needs the sequence length, and the model's config states no maximum; launch with "
            "`zerotron run --autotuning run` (it measures the first batch) or set train_micro_batch_size_per_gpu",
        )
    zero = raw.get("zero_optimization") if isinstance(raw.get("zero_optimization"), dict) else {}
    stage = _number(zero, "stage")
    tp = _number(raw.get("tensor_parallel") or {}, "autotp_size") or int(section.get("mp_size", 1))
    dp = max(1, world_size // tp)
    min_train = int(section.get("min_train_batch_size", 1))
    hw = this_machine(int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
    best, _ = tune(
        shape,
        world_size,
        hw,
        seq,
        dtype,
        stages=(stage,) if stage is not None else (0, 1, 2, 3) if enabled else (0,),
        tp=tp,
        min_micro_batch=max(int(section.get("min_train_micro_batch_size_per_gpu", 1)), math.ceil(min_train / dp)),
        max_micro_batch=int(section.get("max_train_micro_batch_size_per_gpu", 1024)),
        train_batch=_number(raw, "train_batch_size"),
        gas=_number(raw, "gradient_accumulation_steps"),
        max_train_batch=section.get("max_train_batch_size"),
        metric=section.get("metric", "throughput"),
    )
    layout = best.layout
    what = (
        f"ZeRO-{layout.zero}, micro-batch {layout.micro_batch} x {layout.grad_accum} accumulation on "
        f"{dp} data-parallel ranks ({best.memory['total'] / GIB:.2f} GiB of {hw.memory_gib:.0f} per "
        f"{'GPU' if hw.name != 'cpu' else 'rank'}, {best.speed['tokens_per_s']:.0f} tokens/s predicted, "
        f"sequences of {seq} tokens)"
    )
    given = _number(raw, "train_micro_batch_size_per_gpu")
    if given is not None and keep_given:
        logger.info(f"autotuning: keeping the micro-batch the script set ({given}); the planner would choose {what}")
        return raw
    raw["train_micro_batch_size_per_gpu"] = layout.micro_batch
    raw["gradient_accumulation_steps"] = layout.grad_accum
    if is_auto(raw.get("train_batch_size")):
        del raw["train_batch_size"]
    if stage is None and enabled:
        raw.setdefault("zero_optimization", {})["stage"] = layout.zero
    logger.info(f"autotuning (predicted by the planner, no trial runs): {what}")
    return raw
