"""DeepSpeed's autotuning, predicted: the "autotuning" config section and "auto" batch sizes answered by the
planner instead of by a dozen trial runs.

Two ways in, as with DeepSpeed:
- `initialize()` with `"autotuning": {"enabled": true}` (or with every batch size left "auto" and nothing to
  derive them from): the planner chooses the ZeRO stage (when the config leaves it open) and the largest
  micro-batch that fits, from the model's shape, the machine and the config; one log line says what it chose.
  With no launcher to measure them, sequences are taken as long as the model allows (a safe upper bound).
- `zerotron run --autotuning tune|run script.py --deepspeed ds_config.json ...`, DeepSpeed's launcher flag:
  one short probe run of the script records the model and the real sequence length at its first forward,
  the planner chooses, the tuned config and command are written where DeepSpeed writes them
  (`autotuning_results/ds_config_optimal.json`, `cmd_optimal.txt`), and "run" then launches the script with
  them, `arg_mappings` carrying the choice to the script's own flags (the Hugging Face Trainer's
  --per_device_train_batch_size).
"""

from .resolve import ENV_PROBE, ENV_TUNED, resolve

__all__ = ["resolve", "ENV_PROBE", "ENV_TUNED"]
