"""DeepSpeed's module paths on zerotron, and the opt-in `deepspeed` import alias.

Two ways in:

- Renamed, `import zerotron as deepspeed`: DeepSpeed's paths exist below zerotron too, as the very
  modules the table in `paths.py` names -- `import zerotron.utils` gives `zerotron.compat.utils`
  (one object, entered in sys.modules under both names), and attribute chains import what they
  reach (`zerotron.runtime.zero.partition_parameters.ZeroParamStatus`). Installed whenever zerotron
  is imported; nothing named `deepspeed` changes.
- Aliased, for code that says `import deepspeed` and can't be edited (the Hugging Face Trainer,
  accelerate, TRL): `zerotron.as_deepspeed()`, or `ZEROTRON_AS_DEEPSPEED=1` in the environment (the
  start-up hook `_zerotron_startup`, run from `zerotron-startup.pth`, turns it on at the first
  lookup of `deepspeed`; `zerotron run --as-deepspeed` sets it for the workers). Then `deepspeed`
  *is* zerotron and `deepspeed.<path>` is the table's module, and `importlib.metadata` knows a
  distribution `deepspeed` of version `0.18.2+zerotron.<zerotron's version>` -- what transformers,
  accelerate and TRL read before they use DeepSpeed (`importlib.util.find_spec("deepspeed")`, then
  `importlib.metadata.version("deepspeed")` for their feature gates). `deepspeed.__version__` is
  zerotron's own `__version__`: the alias is the same module object, so isinstance checks and
  module state are shared, and no library we know gates on the attribute.

Three pieces on sys.meta_path, none of which can shadow a real zerotron module:

- `_PathTable`, appended at the END on `import zerotron`: `zerotron.<path>` for table paths no real
  module answers (every finder before it, PathFinder included, said no).
- `_Aliases`, inserted at the FRONT on `import zerotron`: children of alias modules. Below
  `zerotron.runtime` (which is `zerotron.compat.runtime`) PathFinder would load
  `zerotron/compat/runtime/zero/` a second time, as a new module named `zerotron.runtime.zero`;
  this finder serves it as the existing `zerotron.compat.runtime.zero`. A name below an alias cannot
  be a real module, so answering first takes nothing from anyone. Once activated, it also serves
  `deepspeed` / `deepspeed.*` and the `deepspeed` distribution, ahead of an installed DeepSpeed.
- The start-up hook's bootstrap finder, only under ZEROTRON_AS_DEEPSPEED, until first used.

Coexisting with a real DeepSpeed: the alias is off unless asked for. Asked for while the real one
is already imported: an error (code already holding the real module would keep using it, two
engines in one process). Asked for while one is installed but not imported: a `ShadowWarning`
naming it, and the alias wins for this process only -- the user asked for exactly that, and the
installed package is untouched for every other process.

Python refuses `import a.b` when `a` is a plain module (not a package) before asking any finder,
so table paths below a plain module (`ops.adam.fused_adam`, `comm.comm`) are entered in sys.modules
when their parent is served through the alias (`deepspeed.ops.adam`, `zerotron.accelerator`);
below a real zerotron module imported directly (`import zerotron.ops.adam.fused_adam`) they need
that module to be a package.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import os
import pathlib
import re
import sys
import warnings

from . import paths

ENV = "ZEROTRON_AS_DEEPSPEED"
DEEPSPEED_API_VERSION = "0.18.2"  # the DeepSpeed release whose API zerotron's surface follows
PTH_NAME = "zerotron-startup.pth"
_MISSING = object()


class AliasError(RuntimeError):
    """as_deepspeed() refused: a real DeepSpeed is already imported in this process."""


class ShadowWarning(UserWarning):
    """as_deepspeed() hides an installed (not yet imported) DeepSpeed for this process."""


def env_activated(environ=os.environ) -> bool:
    """ZEROTRON_AS_DEEPSPEED set to anything but "", 0, false, no, off (the start-up hook's rule)."""
    return environ.get(ENV, "").strip().lower() not in ("", "0", "false", "no", "off")


def deepspeed_version() -> str:
    """The version `importlib.metadata.version("deepspeed")` reports under the alias."""
    return f"{DEEPSPEED_API_VERSION}+zerotron.{sys.modules['zerotron'].__version__}"


# ---- serving one alias ------------------------------------------------------------------------
def _is_alias(name: str) -> bool:
    """`name` is in sys.modules as a module of another name (the alias's own entries)."""
    module = sys.modules.get(name)
    return module is not None and getattr(module, "__name__", name) != name


def _spec(name: str, target: str, listed: bool):
    """A spec for alias `name` of module `target`. `listed`: named by the table (or the package
    itself), so a missing target is an error that says so; else a derived name, absent if the
    target does not exist."""
    try:
        found = importlib.util.find_spec(target)
    except (ImportError, ValueError):
        found = None
    if found is None and not listed:
        return None
    spec = importlib.machinery.ModuleSpec(
        name, _AliasLoader(target, listed), origin=found.origin if found is not None else None
    )
    if found is not None and found.submodule_search_locations is not None:
        spec.submodule_search_locations = list(found.submodule_search_locations)
    return spec


class _NotServed(importlib.abc.Loader):
    """A DeepSpeed package zerotron does not implement (paths.NOT_SERVED): importing it says so, and what to do."""

    def __init__(self, why: str):
        self.why = why

    def create_module(self, spec):
        raise ModuleNotFoundError(f"{spec.name}: {self.why}", name=spec.name)

    def exec_module(self, module):  # (never reached: create_module raises)
        raise ModuleNotFoundError(self.why)


class _AliasLoader(importlib.abc.Loader):
    """Loads an alias as its target: the same module object, nothing executed twice."""

    def __init__(self, target: str, listed: bool):
        self.target, self.listed = target, listed

    def create_module(self, spec):
        try:
            module = importlib.import_module(self.target)
        except ImportError as e:
            where = "zerotron/compat/paths.py maps it to" if self.listed else "it would be"
            raise ModuleNotFoundError(
                f"No module named {spec.name!r}: {where} {self.target!r}, which could not be imported ({e})",
                name=spec.name,
            ) from e
        parent, _, child = spec.name.rpartition(".")
        if parent:  # the import system will set parent.<child> = module: never over something else
            held = vars(sys.modules[parent]).get(child, _MISSING)
            if held is not _MISSING and held is not module:
                raise ImportError(
                    f"{spec.name!r} -> {self.target!r} would replace "
                    f"{sys.modules[parent].__name__}.{child} ({held!r}); fix the entry in "
                    f"zerotron/compat/paths.py",
                    name=spec.name,
                )
        spec.loader_state = module.__spec__  # the import system overwrites __spec__; exec_module puts it back
        return module

    def exec_module(self, module):
        alias = module.__spec__
        module.__spec__ = alias.loader_state
        _register_children(alias.name, module)
        _attach(module)


def _register_children(alias: str, module) -> None:
    """Table paths below a plain module (not a package): Python will not look for `alias.<child>`
    at all, so enter them now (their targets are cheap: mostly the module itself)."""
    if getattr(module, "__path__", None) is not None:
        return
    for child, target in paths.children(module.__name__).items():
        name = f"{alias}.{child}"
        if name in sys.modules:
            continue
        try:
            sub = importlib.import_module(target)
        except ImportError:
            continue  # `import alias.child` then fails; the table test names the missing target
        held = vars(module).get(child, _MISSING)
        if held is _MISSING:
            setattr(module, child, sub)
        elif held is not sub:
            continue
        sys.modules[name] = sub


# ---- attribute chains ---------------------------------------------------------------------------
def _attach(module) -> None:
    """Give a zerotron module reached through the alias PEP 562 access to its submodules (and to the
    table's children), unless it has a module `__getattr__` of its own."""
    name = getattr(module, "__name__", "")
    if (
        (name == "zerotron" or name.startswith("zerotron."))
        and "__getattr__" not in vars(module)
        and (getattr(module, "__path__", None) is not None or paths.children(name))
    ):

        def __getattr__(attr, _name=name):
            found = submodule(_name, attr)
            if found is None:
                raise AttributeError(f"module {_name!r} has no attribute {attr!r}")
            return found

        module.__getattr__ = __getattr__


def submodule(module_name: str, attr: str):
    """What `<module>.<attr>` is under DeepSpeed's paths when the module lacks the attribute: the
    table's child, else the submodule of that name; imported. None if neither exists."""
    if attr.startswith("_"):
        return None
    module = sys.modules[module_name]
    target = paths.children(module_name).get(attr)
    if target is None:
        if getattr(module, "__path__", None) is None:
            return None
        target = f"{module_name}.{attr}"
        try:
            if importlib.util.find_spec(target) is None:
                return None
        except (ImportError, ValueError):
            return None
    try:
        sub = importlib.import_module(target)
    except ImportError as e:  # an AttributeError (hasattr() stays usable) that says what is missing
        where = "zerotron/compat/paths.py maps it to" if target != f"{module_name}.{attr}" else "its submodule"
        raise AttributeError(
            f"module {module_name!r} has no attribute {attr!r}: {where} {target!r} could not be imported ({e})"
        ) from e
    if vars(module).get(attr, _MISSING) is _MISSING:
        setattr(module, attr, sub)
    _attach(sub)
    return sub


def top_level(name: str):
    """zerotron's PEP 562 `__getattr__`: DeepSpeed's top-level names and module paths."""
    if name in paths.NAMES:
        path, attr = paths.NAMES[name]
        target = paths.resolve(path)
        try:
            value = getattr(importlib.import_module(target), attr)
        except (ImportError, AttributeError) as e:
            raise AttributeError(
                f"module 'zerotron' has no attribute {name!r}: DeepSpeed's deepspeed.{name} "
                f"is {target}.{attr} here, which is missing ({e})"
            ) from e
        setattr(sys.modules["zerotron"], name, value)
        return value
    found = submodule("zerotron", name)
    if found is None:
        raise AttributeError(f"module 'zerotron' has no attribute {name!r}")
    return found


# ---- the finders --------------------------------------------------------------------------------
class _PathTable(importlib.abc.MetaPathFinder):
    """END of sys.meta_path: `zerotron.<path>` for the table's paths without a real module."""

    def find_spec(self, name, path=None, target=None):
        if not name.startswith("zerotron."):
            return None
        rel = name[len("zerotron.") :]
        if paths.not_served(rel):  # (the rename way: `import zerotron.module_inject`)
            return importlib.machinery.ModuleSpec(name, _NotServed(paths.not_served(rel)))
        if paths.PATHS.get(rel, name) == name or _is_alias(name.rpartition(".")[0]):
            return None
        return _spec(name, paths.PATHS[rel], listed=True)


class _Aliases(importlib.abc.MetaPathFinder):
    """FRONT of sys.meta_path: children of alias modules; `deepspeed` once activated."""

    def __init__(self):
        self.deepspeed = False

    def find_spec(self, name, path=None, target=None):
        parent, _, child = name.rpartition(".")
        if name == "deepspeed" or name.startswith("deepspeed."):
            if not self.deepspeed:
                return None
            rel = name[len("deepspeed.") :] if name != "deepspeed" else ""
        elif name.startswith("zerotron.") and _is_alias(parent):
            rel = name[len("zerotron.") :]
        else:
            return None
        if paths.not_served(rel):
            return importlib.machinery.ModuleSpec(name, _NotServed(paths.not_served(rel)))
        if not rel or rel in paths.PATHS:
            return _spec(name, paths.resolve(rel), listed=True)
        # below an alias, a name the table does not list is that name below the alias's module
        held = sys.modules.get(parent)
        return _spec(name, f"{held.__name__}.{child}" if held is not None else paths.resolve(rel), listed=False)

    def find_distributions(self, context=importlib.metadata.DistributionFinder.Context()):
        if self.deepspeed and (context.name is None or _normalize(context.name) == "deepspeed"):
            return iter([DeepSpeedDistribution()])
        return iter(())


def _normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


class DeepSpeedDistribution(importlib.metadata.Distribution):
    """The `deepspeed` distribution importlib.metadata reports under the alias; no files written."""

    def read_text(self, filename):
        if filename == "METADATA":
            return (
                f"Metadata-Version: 2.1\nName: deepspeed\nVersion: {deepspeed_version()}\n"
                f"Summary: zerotron's DeepSpeed alias: import deepspeed runs zerotron\n"
                f"Home-page: https://github.com/zerotron\nLicense: Apache-2.0\n"
            )
        if filename == "top_level.txt":
            return "deepspeed\n"
        return None

    def locate_file(self, path):
        return pathlib.Path(sys.modules["zerotron"].__file__).parent.parent / path


_aliases = _Aliases()
_path_table = _PathTable()


def install() -> None:
    """On `import zerotron`: DeepSpeed's paths below zerotron (and the alias, under ZEROTRON_AS_DEEPSPEED)."""
    if _aliases not in sys.meta_path:
        sys.meta_path.insert(0, _aliases)
    if _path_table not in sys.meta_path:
        sys.meta_path.append(_path_table)
    if env_activated():
        try:
            as_deepspeed()
        except AliasError as e:  # a real DeepSpeed came first (no start-up hook?): zerotron still imports
            warnings.warn(f"{ENV} is set, but {e}", RuntimeWarning, stacklevel=2)


def _installed_deepspeed():
    """(spec, version) of a real DeepSpeed some other finder would import, else None."""
    for finder in sys.meta_path:
        if (
            finder is _aliases
            or finder is _path_table
            or not hasattr(finder, "find_spec")
            or type(finder).__module__ == "_zerotron_startup"
        ):
            continue
        try:
            spec = finder.find_spec("deepspeed", None)
        except Exception:  # noqa: BLE001  (a foreign finder's trouble is not ours)
            continue
        # A directory named deepspeed without an __init__.py (examples/deepspeed/ when run from a
        # checkout) is only a namespace package: no DeepSpeed is installed there.
        if spec is not None and spec.origin not in (None, "namespace"):
            versions = [
                d.version
                for d in importlib.metadata.distributions(name="deepspeed")
                if not isinstance(d, DeepSpeedDistribution)
            ]
            return spec, versions[0] if versions else None
    return None


def as_deepspeed():
    """Make `import deepspeed` (and `deepspeed.<path>`, and importlib.metadata's "deepspeed") give
    zerotron, in this process from now on. Idempotent; returns the zerotron module. Raises
    AliasError if a real DeepSpeed is already imported; warns (ShadowWarning) if one is installed."""
    zerotron = sys.modules["zerotron"]
    if _aliases.deepspeed:
        return zerotron
    held = sys.modules.get("deepspeed")
    if held is not None and held is not zerotron:
        raise AliasError(
            f"zerotron.as_deepspeed(): a real 'deepspeed' is already imported in this process "
            f"({getattr(held, '__file__', held)!r}); code holding it would keep using it beside zerotron. "
            f"Call zerotron.as_deepspeed() before anything imports deepspeed, or start the process with "
            f"{ENV}=1."
        )
    installed = _installed_deepspeed()
    if installed is not None:
        spec, version = installed
        warnings.warn(
            ShadowWarning(
                f"zerotron.as_deepspeed(): 'import deepspeed' now gives zerotron in this process; the installed "
                f"DeepSpeed{' ' + version if version else ''} at {spec.origin!r} is hidden here (and "
                f"importlib.metadata.version('deepspeed') reports {deepspeed_version()!r}). Other processes "
                f"still get the real one."
            ),
            stacklevel=2,
        )
    if sys.meta_path and sys.meta_path[0] is not _aliases:  # ahead of anything inserted since import
        if _aliases in sys.meta_path:
            sys.meta_path.remove(_aliases)
        sys.meta_path.insert(0, _aliases)
    _aliases.deepspeed = True
    return zerotron


def startup_hook_installed() -> bool:
    """The .pth that runs the start-up hook sits in a site directory of this interpreter (what
    workers started with ZEROTRON_AS_DEEPSPEED=1 need)."""
    import site

    dirs = [*getattr(site, "getsitepackages", lambda: [])(), site.getusersitepackages(), *sys.path]
    return any(os.path.isfile(os.path.join(d, PTH_NAME)) for d in dirs if isinstance(d, str) and d)
