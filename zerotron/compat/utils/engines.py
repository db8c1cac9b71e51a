"""Which zerotron engines are alive, for DeepSpeed's module-level functions that take no engine
(the `groups` accessors, `safe_get_full_*`, isinstance checks on the ZeRO optimizer classes).

zerotron's core does not know about this registry. An engine is known here when something calls
`register_engine(engine)` (the `deepspeed` alias's initialize, or a script), or when a walk over
the garbage collector's objects finds it. A walk costs about a second in a process that has
imported Transformers, so it runs only when an engine may have been built since the last one:
every Engine construction calls zerotron.checkpointing.reset(), which replaces that module's
settings object, and a walk runs when that object has changed.
"""

from __future__ import annotations

import gc
import itertools
import weakref

_order = itertools.count()
_known: dict[int, tuple[int, bool, weakref.ref]] = {}  # id(engine) -> (order, registered?, weak reference)
_walked_at = None  # zerotron.checkpointing's settings object at the last walk


def _engine_class():
    from ...engine import Engine

    return Engine


def register_engine(engine):
    """Make `engine` the one module-level DeepSpeed functions answer for (the most recently
    registered live engine wins over every other). Returns the engine."""
    if not isinstance(engine, _engine_class()):
        raise TypeError(f"register_engine expects a zerotron engine, not {type(engine).__name__}")
    _known[id(engine)] = (next(_order), True, weakref.ref(engine))
    return engine


def _walk():
    """Remember every live engine not seen before (see the module docstring for when this runs).
    Engines first seen in one walk are ordered by when they last reset their step clock, which
    for a new engine is the end of its construction."""
    global _walked_at
    from ... import activation_checkpointing as checkpointing

    settings = checkpointing._settings
    if settings is _walked_at:
        return
    _walked_at = settings
    cls = _engine_class()
    # type(), not isinstance: some objects (lazy proxies) raise when asked for __class__
    new = [o for o in gc.get_objects() if issubclass(type(o), cls) and not _is_known(o)]
    for engine in sorted(new, key=lambda e: getattr(e, "_created_at", 0.0)):
        _known[id(engine)] = (next(_order), False, weakref.ref(engine))


def _alive(registered_first: bool = False) -> list:
    """Live engines, newest first (with `registered_first`, registered ones before the others)."""
    out = []
    for key, (order, registered, ref) in list(_known.items()):
        engine = ref()
        if engine is None:
            del _known[key]
        else:
            out.append(((registered if registered_first else False, order), engine))
    return [e for _, e in sorted(out, key=lambda t: t[0], reverse=True)]


def _is_known(obj) -> bool:
    entry = _known.get(id(obj))
    return entry is not None and entry[2]() is obj  # (an id can be reused once its engine is gone)


def live_engines() -> list:
    """The live engines, newest first: registered ones before those found by the walk."""
    _walk()
    return _alive(registered_first=True)


def current_engine(required: bool = True):
    """The most recently registered live engine; without one, the newest live engine found."""
    engines = live_engines()
    if engines:
        return engines[0]
    if required:
        raise RuntimeError("no zerotron engine is alive in this process: call zerotron.initialize(...) first")
    return None


def find_engine(match):
    """The newest live engine for which match(engine) is true, or None."""
    _walk()
    return next((e for e in _alive() if match(e)), None)


_param_ids: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _params_of(engine) -> set[int]:
    ids = _param_ids.get(engine)
    if ids is None:
        ids = _param_ids[engine] = {id(p) for p in engine.module.parameters()}
    return ids


def engine_of_param(param):
    """The live engine training `param`, or None."""
    return find_engine(lambda e: id(param) in _params_of(e))


def engine_of_optimizer(optimizer):
    """The live engine whose optimizer is `optimizer`, or None."""
    return find_engine(lambda e: e.optimizer is optimizer)
