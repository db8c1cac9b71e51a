"""How long a collective may take: the timeout a script gave `init_distributed` (DeepSpeed's
argument), read by the process groups zerotron makes (topology), the watchdog and comm. It sits
below all three so each can ask without importing the others."""

from __future__ import annotations

import datetime

DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)

_requested: datetime.timedelta | None = None  # what a script gave init_distributed, if anything


def request(timeout) -> None:
    """Record a script's timeout (a timedelta or seconds); DEFAULT_TIMEOUT or None records nothing."""
    global _requested
    if timeout is not None and timeout != DEFAULT_TIMEOUT:
        _requested = timeout if isinstance(timeout, datetime.timedelta) else datetime.timedelta(seconds=timeout)


def requested_timeout() -> datetime.timedelta | None:
    return _requested


def group_timeout() -> datetime.timedelta:
    """The timeout of every process group zerotron creates: init_distributed's, else 30 minutes.
    The watchdog takes the same timeout (watchdog.default_timeout_s) and reports first; the
    backend's own, a few seconds later, is the backstop."""
    timeout = _requested or DEFAULT_TIMEOUT
    return timeout + max(datetime.timedelta(seconds=10), timeout * 0.1)
