"""The worker `zerotron run --as-deepspeed` starts: the script run with `--local_rank=N` first among its
arguments, as DeepSpeed's launcher passes it (scripts written for it read `args.local_rank`, and without
it think they run on one process: DeepSpeed-Chat's steps, DeepSpeedExamples). `--no_local_rank` on
`zerotron run` leaves it out, as on DeepSpeed's launcher."""

from __future__ import annotations

import os
import runpy
import sys


def main() -> None:
    script, *rest = sys.argv[1:]
    local_rank = f"--local_rank={os.environ.get('LOCAL_RANK', '0')}"
    if script == "-m":
        module, *rest = rest
        sys.argv = [module, local_rank, *rest]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        sys.argv = [script, local_rank, *rest]
        sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python script.py` has it (not `-m`'s cwd)
        runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
