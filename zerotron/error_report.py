"""How a launched job reports an error zerotron raised: its message once, without a traceback.

A bad config raises the same ConfigError on every rank; with Python's default hook a job of N
processes prints N tracebacks and torchrun adds its failure table, 55-168 lines for one sentence.
Here rank 0 prints the message for errors every rank raises alike, each rank prints its own
otherwise, and the message goes to torchrun's error file too, so its failure table names it.
Under zerotron's own launcher (`zerotron run`, `zerotron train`) the workers print nothing: the
launcher prints the first failure's message once. ZEROTRON_DEBUG=1 brings the tracebacks back.
"""

from __future__ import annotations

import json
import os
import sys
import time

from .errors import ZerotronError

DEBUG_ENV = "ZEROTRON_DEBUG"
LAUNCHER_ENV = "ZEROTRON_LAUNCHER"  # set by zerotron's launcher for its workers
# A rank that only echoes rank 0's error waits this long before exiting: torchrun stops the other
# workers as soon as one exits, and rank 0 must have printed by then.
ECHO_GRACE_S = 1.0


def debugging() -> bool:
    return os.environ.get(DEBUG_ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


def install() -> None:
    """In a launched worker: an uncaught ZerotronError is reported (report()), not traced back."""
    if debugging() or getattr(sys.excepthook, "zerotron", False):
        return
    previous = sys.excepthook

    def hook(kind, value, traceback):
        if isinstance(value, ZerotronError):
            report(value)
        else:
            previous(kind, value, traceback)

    hook.zerotron = True
    sys.excepthook = hook


def report(error: ZerotronError) -> None:
    """Print `error`'s message as this rank should (see the module's doc) and record it for torchrun."""
    message = f"zerotron: {error}"
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:  # torchrun's format (its ErrorHandler.record_exception), the message in place of the traceback
        with open(path, "w") as f:
            json.dump(
                {
                    "message": {
                        "message": message,
                        "extraInfo": {"py_callstack": message, "timestamp": str(int(time.time()))},
                    }
                },
                f,
            )
    if os.environ.get(LAUNCHER_ENV) == "1" and path:
        return
    rank = int(os.environ.get("RANK", "0"))
    if not error.same_on_every_rank:
        print(
            message if int(os.environ.get("WORLD_SIZE", "1")) == 1 else f"[rank {rank}] {message}",
            file=sys.stderr,
            flush=True,
        )
    elif rank == 0:
        print(message, file=sys.stderr, flush=True)
    else:
        time.sleep(ECHO_GRACE_S)


def reported_message(failure) -> str | None:
    """The message report() recorded for a failed worker (torchrun's ProcessFailure), else None."""
    message = failure.message.get("message") if isinstance(failure.message, dict) else failure.message
    return message if isinstance(message, str) and message.startswith("zerotron: ") else None
