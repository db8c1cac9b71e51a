"""The `zerotron` logger: INFO to stderr on rank 0 unless the application configured logging."""

import logging
import os

logger = logging.getLogger("zerotron")


def _setup():
    if logger.handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("[zerotron] %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO if os.environ.get("RANK", "0") == "0" else logging.WARNING)
    logger.propagate = False


_setup()


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def warn(message, category=UserWarning):
    """warnings.warn attributed to the first caller outside zerotron (the user's line that handed
    in the config, the model or the optimizer), however deep inside zerotron the check runs."""
    import sys
    import warnings

    frame, level = sys._getframe(1), 2  # stacklevel 2 is our caller
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE_DIR):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)
