"""The GPU runbook's parts, each run in a child process of its own by tools/gpu/run.py (child_main): `mfu` and
`ckpt` in throughput.py, `offload` and `offload_off` in offload.py, `correct` and `sanitized` in checks.py; what
they share (the device, the model, the log) in device.py, the arithmetic that sizes the offload part in sizing.py."""

from __future__ import annotations

import math
import traceback

from tools import reporting
from tools.gpu import checks
from tools.gpu.device import Device, describe_error
from tools.gpu.offload import job_offload, job_offload_off
from tools.gpu.throughput import job_ckpt, job_mfu

JOBS = {
    "correct": checks.job_correct,
    "mfu": job_mfu,
    "ckpt": job_ckpt,
    "offload": job_offload,
    "offload_off": job_offload_off,
    "sanitized": checks.job_sanitized,
}


def child_main(args) -> int:
    if args.deadline is None:
        args.deadline = math.inf
    result = {"job": args.job}

    def save():
        if args.result_file is not None:
            reporting.write_json(args.job, result, args.result_file)

    try:
        dev = Device()
        result["device"] = dev.describe()
        save()
        JOBS[args.job](args, dev, result, save)
    except Exception as e:  # noqa: BLE001 - recorded, and the parent goes on with the next part
        traceback.print_exc()
        result["error"] = describe_error(e)
    save()
    return 0
