"""Attributes replaced for as long as a session runs, and put back after (or removed, where they were
inherited)."""

from __future__ import annotations

import contextlib

_MISSING = object()


@contextlib.contextmanager
def installed(patches: list):
    """`patches`: (object, attribute name, value) to set for the block's duration."""
    saved = [(obj, name, obj.__dict__.get(name, _MISSING)) for obj, name, _ in patches]
    for obj, name, value in patches:
        setattr(obj, name, value)
    try:
        yield
    finally:
        for obj, name, value in reversed(saved):
            if value is _MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, value)
