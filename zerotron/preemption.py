"""Preemption: SIGTERM or SIGINT asks every rank to finish its current step, checkpoint and exit.

The handler only records the signal; the engine's step boundary shares it across ranks (signals
reach ranks at different moments) so all of them stop after the same step. Installed by
`zerotron train --save-dir` and by the config key `zerotron.save_on_preemption`; a second SIGINT
interrupts at once, as Ctrl-C normally does.
"""

from __future__ import annotations

import signal
import threading

_requested: int | None = None


def _handler(signum, frame):
    global _requested
    if _requested is not None and signum == signal.SIGINT:
        raise KeyboardInterrupt
    _requested = signum


def install() -> bool:
    """Handle SIGTERM and SIGINT from now on (main thread only); True if installed."""
    if threading.current_thread() is not threading.main_thread():
        return False
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _handler)
    return True


def requested() -> int | None:
    """The signal received, if any."""
    return _requested


def reset() -> None:
    global _requested
    _requested = None
