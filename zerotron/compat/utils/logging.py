"""`deepspeed.utils.logging`: zerotron's logger and DeepSpeed's rank-filtered logging helpers."""

from __future__ import annotations

import functools
import logging
import os

import torch.distributed as dist

from ...log import logger

LOG_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}
log_levels = LOG_LEVELS  # DeepSpeed's name


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else -1


def get_dist_msg(message, ranks=None):
    """`message` prefixed with this rank ("[Rank 1] ..."), or None when this rank should stay quiet.
    As DeepSpeed: every rank speaks when torch.distributed is not initialized; otherwise only
    the ranks listed, and all of them when the list starts with -1. No list (or []): no rank."""
    rank = _rank()
    speak = not dist.is_initialized()
    ranks = list(ranks or [])
    if ranks and not speak:
        speak = ranks[0] == -1 or rank in ranks
    return f"[Rank {rank}] {message}" if speak else None


def _threshold() -> int:
    """The level below which log_dist stays quiet: the logger's own, except that zerotron's
    logger quiets ranks other than 0 to WARNING (so the engine's own messages appear once); a
    rank named in log_dist's `ranks` should still speak at INFO, as rank 0 does."""
    level = logger.getEffectiveLevel()
    if level == logging.WARNING and os.environ.get("RANK", "0") != "0":
        return logging.INFO
    return level


def log_dist(message, ranks=None, level=logging.INFO):
    """Log `message` on the ranks get_dist_msg selects (DeepSpeed's semantics)."""
    text = get_dist_msg(message, ranks)
    if text is not None and level >= _threshold():
        logger._log(level, text, (), stacklevel=2)  # past the logger's own level: see _threshold


def print_dist(message, ranks=None):
    """print() on the ranks get_dist_msg selects, whatever the log level."""
    text = get_dist_msg(message, ranks)
    if text is not None:
        print(text)


@functools.lru_cache(None)
def _log_once(message, ranks, level):
    log_dist(message, ranks=None if ranks is None else list(ranks), level=level)


def log_dist_once(message, ranks=None, level=logging.INFO):
    """log_dist, at most once per process for each (message, ranks, level)."""
    _log_once(message, None if ranks is None else tuple(ranks), level)


@functools.lru_cache(None)
def warning_once(*args, **kwargs):
    """logger.warning, once per distinct arguments."""
    logger.warning(*args, **kwargs)


def get_log_level_from_string(log_level_str: str) -> int:
    try:
        return LOG_LEVELS[log_level_str.lower()]
    except KeyError:
        raise ValueError(f"log level {log_level_str!r}: use one of {', '.join(LOG_LEVELS)}") from None


def set_log_level_from_string(log_level_str: str, custom_logger=None):
    """Set the level of `custom_logger` (default: zerotron's logger) and of its handlers."""
    target = custom_logger or logger
    level = get_log_level_from_string(log_level_str)
    target.setLevel(level)
    for handler in target.handlers:
        handler.setLevel(level)


def print_configuration(args, name):
    logger.info(f"{name}:")
    for key in sorted(vars(args)):
        logger.info(f"  {key} {'.' * (29 - len(key))} {getattr(args, key)}")
