"""ZeRO-3 leaf modules (DeepSpeed's `set_z3_leaf_modules` & co.).

A leaf module's parameters are gathered together when the module starts and are never split
into smaller gather units below it: a Mixture-of-Experts block whose experts run in a
data-dependent order, or a module with many tiny submodules. The mark is DeepSpeed's: the
boolean attribute `_z3_leaf` on the module, read by zerotron's ZeRO-3 when it chooses its
units (zerotron/zero/stage3.py), so it must be set before `zerotron.initialize`.
"""

from __future__ import annotations

import torch.nn as nn

LEAF_ATTR = "_z3_leaf"


def z3_leaf_module(model: nn.Module) -> bool:
    """Is `model` marked as a ZeRO-3 leaf?"""
    return bool(getattr(model, LEAF_ATTR, False))


def z3_leaf_parameter(param) -> bool:
    """Does `param` belong to a leaf module (DeepSpeed's `ds_z3_leaf_module` attribute)?"""
    return hasattr(param, "ds_z3_leaf_module")


def get_z3_leaf_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if z3_leaf_module(m)]


def set_z3_leaf_module(model: nn.Module, flag: bool):
    setattr(model, LEAF_ATTR, flag)


def _qualified_name(module: nn.Module) -> str:
    cls = type(module)
    return f"{cls.__module__}.{cls.__qualname__}"


def _matches(module: nn.Module, wanted) -> bool:
    if isinstance(wanted, type):
        return isinstance(module, wanted)
    return wanted in (type(module).__name__, _qualified_name(module))


def _mark_classes(model, leaf_module_classes, flag: bool, raise_if_not_found: bool) -> list[nn.Module]:
    classes = list(leaf_module_classes)
    bad = [c for c in classes if not isinstance(c, (type, str))]
    if bad:
        raise TypeError(f"leaf_module_classes must be module classes or class names, got {bad!r}")
    marked = [m for m in model.modules() if any(_matches(m, c) for c in classes)]
    for m in marked:
        set_z3_leaf_module(m, flag)
    if not marked and raise_if_not_found:
        names = [c if isinstance(c, str) else c.__name__ for c in classes]
        raise ValueError(f"no module of class {names} in {type(model).__name__}")
    return marked


def set_z3_leaf_modules(model: nn.Module, leaf_module_classes, raise_if_not_found: bool = True) -> list[nn.Module]:
    """Mark every module of the given classes (types, class names or qualified names) as a leaf;
    returns the modules marked."""
    return _mark_classes(model, leaf_module_classes, True, raise_if_not_found)


def unset_z3_leaf_modules(model: nn.Module, leaf_module_classes, raise_if_not_found: bool = True) -> list[nn.Module]:
    """Remove the leaf mark from every module of the given classes; returns those modules."""
    return _mark_classes(model, leaf_module_classes, False, raise_if_not_found)


def set_z3_leaf_modules_by_name(
    model: nn.Module, module_names, flag: bool = True, raise_if_not_found: bool = True
) -> tuple[list[nn.Module], list[str]]:
    """Mark the modules with these names (as `named_modules()` gives them); returns (marked, missing)."""
    by_name = dict(model.named_modules())
    marked, missing = [], []
    for name in module_names:
        if name in by_name:
            set_z3_leaf_module(by_name[name], flag)
            marked.append(by_name[name])
        else:
            missing.append(name)
    if missing and raise_if_not_found:
        raise ValueError(f"no module named {missing} in {type(model).__name__}")
    return marked, missing


def set_z3_leaf_modules_by_suffix(
    model: nn.Module, module_name_suffixes, flag: bool = True, raise_if_not_found: bool = True
) -> tuple[list[nn.Module], list[str]]:
    """Mark the modules whose names end with any of these suffixes; returns (marked, unmatched suffixes)."""
    modules = list(model.named_modules())
    marked, seen, missing = [], set(), []
    for suffix in module_name_suffixes:
        hits = [m for name, m in modules if name.endswith(suffix)]
        if not hits:
            missing.append(suffix)
        for m in hits:
            set_z3_leaf_module(m, flag)
            if id(m) not in seen:
                seen.add(id(m))
                marked.append(m)
    if missing and raise_if_not_found:
        raise ValueError(f"no module name ends with {missing} in {type(model).__name__}")
    return marked, missing
