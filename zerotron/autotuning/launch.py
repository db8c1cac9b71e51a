"""`zerotron run --autotuning tune|run`: DeepSpeed's launcher flag, with one probe run instead of a dozen trials.

1. The probe: the script runs unchanged under the launcher, with the micro-batch mapped to 1 and the config
   without its autotuning section (at ZeRO-3 where the stage is open, as DeepSpeed's model-info run); initialize()
   records the model and the first forward's sequence length (model_info.py) in
   `<exps_dir>/profile_model_info/model_info.json`, and the job stops there.
2. The choice: the planner's (resolve.choose), written as `<results_dir>/ds_config_optimal.json` (the config
   without its autotuning section) and `<results_dir>/cmd_optimal.txt` (the command that runs it), as DeepSpeed's
   autotuner writes them.
3. "run" launches that command: the script gets the tuned config in place of its --deepspeed / --deepspeed_config
   file and, through `arg_mappings`, the tuned values in its own flags.
"""

from __future__ import annotations

import copy
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

from ..config import read_raw
from ..errors import ConfigError
from ..log import logger
from .model_info import read_probe
from .resolve import BATCH, ENV_PROBE, ENV_TUNED, check_section, choose

CONFIG_FLAGS = ("--deepspeed_config", "--deepspeed")  # the first one present names the config, as DeepSpeed reads them


def _config_index(script_args: list[str]) -> int:
    for flag in CONFIG_FLAGS:
        if flag in script_args:
            i = script_args.index(flag) + 1
            if i < len(script_args) and script_args[i].endswith(".json"):
                return i
    raise ConfigError(
        "autotuning",
        "--autotuning",
        "the tuner reads the DeepSpeed config the script is given: pass it as --deepspeed ds_config.json or "
        "--deepspeed_config ds_config.json after the script",
    )


def map_arguments(script_args: list[str], config: dict, mappings: dict | None) -> list[str]:
    """The script's flags with the config's values where `arg_mappings` names a flag for a config key
    (replacing the flag's value, or appending the flag when the script was not given it)."""
    out = list(script_args)
    for key, flag in (mappings or {}).items():
        key = key.strip()  # DeepSpeedExamples' configs write "gradient_accumulation_steps " with a space
        if key not in config:
            continue
        value = str(config[key])
        if flag in out and out.index(flag) + 1 < len(out):
            out[out.index(flag) + 1] = value
        else:
            out += [flag, value]
    return out


def tune_then_run(mode: str, launcher_argv: list[str], script: str, script_args: list[str]) -> int:
    """The three steps above; `launcher_argv`: `zerotron run`'s own flags (how many processes, nodes...)."""
    index = _config_index(script_args)
    raw = read_raw(script_args[index])
    section = raw.get("autotuning") if isinstance(raw.get("autotuning"), dict) else {}
    check_section(section)
    results = Path(section.get("results_dir", "autotuning_results"))
    config_path = results / "ds_config_optimal.json"

    def launch(args: list[str], env: dict) -> int:
        command = [sys.executable, "-m", "zerotron.cli", "run", *launcher_argv, script, *args]
        return subprocess.run(command, env={**os.environ, **env}).returncode

    if section.get("overwrite", True) is False and config_path.exists():  # DeepSpeed's meaning: keep what is there
        logger.info(f"autotuning: {config_path} exists and overwrite is false: using it")
        tuned = json.loads(config_path.read_text())
    else:
        tuned = _probe_and_choose(raw, section, script, script_args, index, launch)
        if tuned is None:
            return 1
        results.mkdir(parents=True, exist_ok=True)
        config_path.write_text(json.dumps(tuned, indent=2) + "\n")
    run_args = map_arguments(script_args, tuned, section.get("arg_mappings"))
    run_args[index] = str(config_path)
    (results / "cmd_optimal.txt").write_text(shlex.join(["zerotron", "run", *launcher_argv, script, *run_args]) + "\n")
    logger.info(f"autotuning: wrote {config_path} and {results / 'cmd_optimal.txt'}")
    if mode == "tune":
        return 0
    return launch(run_args, {ENV_TUNED: "1"})


def _probe_and_choose(raw: dict, section: dict, script: str, script_args: list[str], index: int, launch) -> dict | None:
    """Steps 1 and 2: the tuned config (without its autotuning section), or None when the probe failed. The probe
    gets the config without the section (accelerate refuses one without a zero_optimization section), at the
    config's ZeRO stage; where that is open, at ZeRO-1, where the script sees whole parameters (at ZeRO-3 the
    Transformers examples read a partitioned embedding's size as 0 and resize it to the tokenizer's, a model the
    tuned run may not build), and if that run fails (a model too big for one rank), at ZeRO-3."""
    where = Path(section.get("exps_dir", "autotuning_exps")) / "profile_model_info"
    probe_path = where / "model_info.json"
    where.mkdir(parents=True, exist_ok=True)
    given = raw.get("zero_optimization")
    for stage in [None] if isinstance(given, dict) and "stage" in given else [1, 3]:
        config = {k: v for k, v in raw.items() if k != "autotuning"}
        if stage is not None:
            config["zero_optimization"] = {**(given if isinstance(given, dict) else {}), "stage": stage}
        (where / "ds_config.json").write_text(json.dumps(config, indent=2) + "\n")
        probe_args = map_arguments(script_args, {k: 1 for k in BATCH[1:]}, section.get("arg_mappings"))
        probe_args[index] = str(where / "ds_config.json")
        probe_path.unlink(missing_ok=True)
        logger.info(f"autotuning: probe run (stops at the first forward), recording the model in {probe_path}")
        code = launch(probe_args, {ENV_PROBE: str(probe_path.resolve())})
        if code == 0 and probe_path.exists():
            break
    else:
        print(
            f"zerotron run --autotuning: the probe run of {script} exited with status {code} before its first "
            f"forward and wrote no {probe_path}; its output is above",
            file=sys.stderr,
        )
        return None
    info = read_probe(str(probe_path))
    tuned = copy.deepcopy(raw)
    tuned.pop("autotuning", None)
    return choose(
        tuned, info["shape"], info["seq"], info["dtype"], info["world_size"], section, enabled=True, keep_given=False
    )
