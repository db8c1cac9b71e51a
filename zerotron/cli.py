"""`zerotron train` (the reference job), `zerotron run` (launch any script through torchrun),
`zerotron convert` (a checkpoint to consolidated safetensors weights), and the planner's
`zerotron estimate` / `zerotron plan`."""

from __future__ import annotations

import argparse
import os
import sys

import torch

from .error_report import report
from .errors import ConfigError, ZerotronError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="zerotron", description="zerotron: distributed training for PyTorch")
    sub = parser.add_subparsers(dest="command", required=True)
    from .train import add_train_arguments

    add_train_arguments(sub.add_parser("train", help="train the reference GPT on the embedded corpus"))
    _add_run_arguments(sub.add_parser("run", help="launch a script on N processes through torchrun"))
    convert = sub.add_parser("convert", help="write a checkpoint's weights as one consolidated safetensors file")
    convert.add_argument("checkpoint", help="a checkpoint directory (save_dir/tag), or a save_dir with 'latest'")
    convert.add_argument("out", help="output directory (gets model.safetensors)")
    convert.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default=None, help="default: fp32 weights")
    convert.add_argument(
        "--from-deepspeed", action="store_true", help="CHECKPOINT is DeepSpeed's: write a zerotron checkpoint to OUT"
    )
    convert.add_argument(
        "--to-deepspeed", action="store_true", help="write CHECKPOINT in DeepSpeed's layout (OUT/<tag>, OUT/latest)"
    )
    convert.add_argument("--zero-stage", type=int, default=None, help="--to-deepspeed: DeepSpeed's ZeRO stage")
    convert.add_argument("--world-size", type=int, default=None, help="--to-deepspeed: DeepSpeed's data-parallel size")
    convert.add_argument(
        "--max-shard-size",
        type=float,
        default=5 * 2**30,
        help="bytes per safetensors file; larger models get shards and an index (default 5 GiB)",
    )
    from .planner.commands import add_estimate_arguments, add_plan_arguments

    add_estimate_arguments(sub.add_parser("estimate", help="memory per GPU for each ZeRO stage"))
    add_plan_arguments(
        sub.add_parser("plan", help="search the parallel layouts that fit; rank them by predicted speed")
    )
    args = parser.parse_args(argv)
    if args.command in ("estimate", "plan"):
        from .planner.commands import estimate, plan_command

        try:
            return estimate(args) if args.command == "estimate" else plan_command(args)
        except (ValueError, FileNotFoundError, RuntimeError) as e:
            print(f"zerotron: {e}", file=sys.stderr)
            return 2
    try:
        if args.command == "train":
            return _train(args, argv if argv is not None else sys.argv[1:])
        if args.command == "convert":
            try:
                print(f"wrote {_convert(args)}")
            except ValueError as e:  # flags that do not go together, a dtype DeepSpeed's layout cannot hold
                print(f"zerotron convert: {e}", file=sys.stderr)
                return 2
            return 0
        return _run(args, argv if argv is not None else sys.argv[1:])
    except FileNotFoundError as e:
        print(f"zerotron: {e}", file=sys.stderr)
        return 1
    except ZerotronError as e:
        report(e)  # once for the whole job when launched (error_report.py)
        return 2 if isinstance(e, ConfigError) else 1


def _convert(args):
    if args.from_deepspeed and args.to_deepspeed:
        raise ValueError("--from-deepspeed or --to-deepspeed, not both")
    if args.from_deepspeed:
        from .checkpoint.from_deepspeed import from_deepspeed

        return from_deepspeed(args.checkpoint, args.out)
    if args.to_deepspeed:
        from .checkpoint.deepspeed_out import to_deepspeed

        return to_deepspeed(args.checkpoint, args.out, args.zero_stage, args.world_size, args.dtype)
    from .checkpoint.export import convert

    return convert(args.checkpoint, args.out, args.dtype or "fp32", int(args.max_shard_size))


# ---- zerotron train ---------------------------------------------------------------------------
def default_nproc() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def _train(args, argv: list[str]) -> int:
    from .comm import launched_by_torchrun

    if launched_by_torchrun():
        from .train import train

        train(args)
        return 0
    from .config import Config
    from .train import adopt_config_layout, build_config, check_model_layout, world_size_of

    adopt_config_layout(args)
    check_model_layout(args)
    nproc = world_size_of(args, default_nproc())
    Config.load(
        build_config(args, torch.cuda.is_available()),
        world_size=nproc,  # fail fast, before launching
        pipeline_stages=args.pp,
    )
    # Relaunch ourselves under torchrun: one process per GPU (or `nproc` CPU processes). --nproc and
    # --max-restarts are torchrun's, dropped from the workers' arguments (torchrun would read
    # --nproc as its own --nproc-per-node).
    ours = ("--nproc", "--max-restarts")
    worker_argv = [a for i, a in enumerate(argv) if not (a.startswith(ours) or (i and argv[i - 1] in ours))]
    return _torchrun(
        [
            "--standalone",
            f"--nproc-per-node={nproc}",
            f"--max-restarts={args.max_restarts}",
            "-m",
            "zerotron.cli",
            *worker_argv,
        ]
    )


# ---- zerotron run -----------------------------------------------------------------------------
def _add_run_arguments(p: argparse.ArgumentParser):
    p.add_argument("-n", "--nproc", type=int, default=None, help="processes per node (default: GPUs, else 2)")
    p.add_argument("--nnodes", default="1", help="nodes, or MIN:MAX for elastic jobs")
    p.add_argument("--node-rank", type=int, default=None)
    p.add_argument("--master-addr", default=None)
    p.add_argument("--master-port", type=int, default=None)
    p.add_argument("--rdzv-backend", default=None)
    p.add_argument("--rdzv-endpoint", default=None)
    p.add_argument("--rdzv-id", default=None)
    p.add_argument("--max-restarts", type=int, default=None)
    p.add_argument(
        "--as-deepspeed",
        action="store_true",
        help="`import deepspeed` in the workers gives zerotron (sets ZEROTRON_AS_DEEPSPEED=1 for them)",
    )
    p.add_argument(
        "--no_local_rank",
        action="store_true",
        help="with --as-deepspeed: do not pass the script --local_rank=N (DeepSpeed's launcher flag)",
    )
    p.add_argument(
        "--local-rank-arg",
        action="store_true",
        help="pass the script --local_rank=N as DeepSpeed's launcher does, without the alias (--as-deepspeed "
        "implies it): for a script renamed to `import zerotron as deepspeed` that reads args.local_rank",
    )
    p.add_argument(
        "--autotuning",
        choices=["tune", "run"],
        default=None,
        help="DeepSpeed's flag: choose the ZeRO stage and micro-batch with the planner after one probe run "
        "(tune), then train with them (run); docs/autotuning.md",
    )
    p.add_argument("script", help="the training script (or -m module)")
    p.add_argument("script_args", nargs=argparse.REMAINDER)


def _run(args, argv: list[str]) -> int:
    if not os.path.exists(args.script) and args.script != "-m":
        print(f"zerotron run: no such script: {args.script}", file=sys.stderr)
        return 2
    if args.autotuning:
        from .autotuning.launch import tune_then_run

        ours = argv[argv.index("run") + 1 : len(argv) - len(args.script_args) - 1]
        at = next(i for i, a in enumerate(ours) if a.startswith("--autotuning"))
        ours = ours[:at] + ours[at + (1 if "=" in ours[at] else 2) :]
        return tune_then_run(args.autotuning, ours, args.script, args.script_args)
    argv = [f"--nproc-per-node={args.nproc or default_nproc()}", f"--nnodes={args.nnodes}"]
    multi_node = args.nnodes != "1" or args.master_addr or args.rdzv_endpoint
    if not multi_node:
        argv.append("--standalone")
    for flag in ("node_rank", "master_addr", "master_port", "rdzv_backend", "rdzv_endpoint", "rdzv_id", "max_restarts"):
        value = getattr(args, flag)
        if value is not None:
            argv.append(f"--{flag.replace('_', '-')}={value}")
    if args.as_deepspeed:
        # The workers are fresh interpreters: zerotron's start-up hook (zerotron-startup.pth in
        # site-packages) reads the variable there, before the script's `import deepspeed`.
        from .compat.alias import ENV, startup_hook_installed

        if not startup_hook_installed():
            print(
                "zerotron run --as-deepspeed: zerotron's start-up hook (zerotron-startup.pth) is not in this "
                "Python's site-packages; install zerotron with pip (`pip install zerotron`, or "
                "`pip install -e .` in a checkout), or call zerotron.as_deepspeed() in the script",
                file=sys.stderr,
            )
            return 2
        os.environ[ENV] = "1"
    if (args.as_deepspeed or args.local_rank_arg) and not args.no_local_rank:
        # as DeepSpeed's launcher: the script gets --local_rank=N
        return _torchrun([*argv, "-m", "zerotron.compat.local_rank", args.script, *args.script_args])
    return _torchrun([*argv, args.script, *args.script_args])


def _torchrun(argv: list[str]) -> int:
    """Run torchrun's agent in this process. Exit status: 0; or the first failed worker's status
    when it is zerotron's (EXIT_PREEMPTED after a checkpoint on SIGTERM, EXIT_FAULT after a
    collective timeout, or an error zerotron raised, whose message is then printed once);
    EXIT_PREEMPTED when this launcher is signalled itself; else 1."""
    import logging

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    from .error_report import LAUNCHER_ENV, debugging, reported_message
    from .errors import EXIT_FAULT, EXIT_PREEMPTED

    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) // max(1, _nproc_of(argv)))))
    os.environ[LAUNCHER_ENV] = "1"  # the workers leave reporting zerotron's errors to this process
    if not debugging():  # "sending SIGTERM to ..." per worker, error files copied: the failure below says what matters
        for name in ("api", "errors.error_handler"):
            logging.getLogger(f"torch.distributed.elastic.multiprocessing.{name}").setLevel(logging.CRITICAL)
    try:
        torchrun_main(argv)
    except ChildFailedError as e:
        failure = e.get_first_failure()[1]  # the root cause; torchrun then stops the others
        message = reported_message(failure)
        if message and not debugging():
            print(message, file=sys.stderr)
            return failure.exitcode if failure.exitcode > 0 else 1
        print(f"zerotron: a worker process failed (exit status {failure.exitcode}): {e}", file=sys.stderr)
        return failure.exitcode if failure.exitcode in (EXIT_FAULT, EXIT_PREEMPTED) else 1
    except SignalException as e:  # SIGTERM/SIGINT to the launcher: torchrun passed it on to the workers
        print(
            f"zerotron: stopped by signal {e.sigval}; the workers checkpointed if they had a --save-dir",
            file=sys.stderr,
        )
        return EXIT_PREEMPTED
    return 0


def _nproc_of(argv: list[str]) -> int:
    for a in argv:
        if a.startswith("--nproc-per-node="):
            return int(a.split("=", 1)[1])
    return 1


if __name__ == "__main__":
    sys.exit(main())
