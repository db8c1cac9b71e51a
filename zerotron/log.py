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
