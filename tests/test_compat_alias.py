"""DeepSpeed's module paths on zerotron and the opt-in `deepspeed` alias (zerotron/compat/alias.py).

Every check of the import system runs in a fresh interpreter (the alias changes sys.meta_path and
sys.modules for the whole process); each subprocess has a timeout.
"""

import ast
import json
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAKE_VERSION = "0.14.0"


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("ZEROTRON_AS_DEEPSPEED", "PYTHONPATH")}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra)
    return env


def _python(code: str, timeout=240, cwd=None, **env):
    """Run `code` in a fresh interpreter (outside the checkout, so the installed zerotron is used);
    its last stdout line is JSON: returned with the whole process result."""
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=_env(**env),
        cwd=cwd or "/",
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.returncode == 0, f"stdout:\n{out.stdout[-3000:]}\nstderr:\n{out.stderr[-5000:]}"
    return json.loads(out.stdout.strip().splitlines()[-1]), out


def _real_deepspeed_installed() -> bool:
    """Is a real DeepSpeed importable here? (Then "no alias" means "the real one", not an error.)"""
    code = "import importlib.util, json; print(json.dumps(importlib.util.find_spec('deepspeed') is not None))"
    return _python(code, timeout=60)[0]


@pytest.fixture
def fake_deepspeed(tmp_path):
    """A 'real' DeepSpeed installation on a temporary sys.path entry: a package and its dist-info."""
    pkg = tmp_path / "deepspeed"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(f"__version__ = {FAKE_VERSION!r}\nREAL = True\n")
    info = tmp_path / f"deepspeed-{FAKE_VERSION}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: deepspeed\nVersion: {FAKE_VERSION}\n")
    (info / "top_level.txt").write_text("deepspeed\n")
    return str(tmp_path)


# ---- the start-up hook --------------------------------------------------------------------------


def _setup_constant(name):
    tree = ast.parse(open(os.path.join(ROOT, "setup.py")).read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError(f"setup.py has no {name}")


def test_the_installed_startup_hook_is_the_one_setup_py_writes_and_installs_nothing_named_deepspeed():
    """The .pth is in this interpreter's site-packages (from `pip install -e .` or the wheel) and is
    current; zerotron's installed files include no module or package named deepspeed."""
    result, _ = _python(
        """
        import importlib.metadata, json, os, site
        dirs = [*site.getsitepackages(), site.getusersitepackages()]
        candidates = [os.path.join(d, "zerotron-startup.pth") for d in dirs]
        pth = [p for p in candidates if os.path.isfile(p)]
        files = [str(f) for f in (importlib.metadata.distribution("zerotron").files or [])]
        print(json.dumps({"pth": [open(p).read() for p in pth], "files": files}))
    """,
        timeout=60,
    )
    assert result["pth"], "zerotron-startup.pth is not installed: reinstall zerotron (pip install -e .)"
    assert result["pth"] == [_setup_constant("PTH_LINE")], "a stale start-up hook: reinstall zerotron"
    assert any(f.endswith("zerotron-startup.pth") for f in result["files"])  # pip uninstall removes it
    for f in result["files"]:
        parts = f.replace("\\", "/").split("/")
        assert "deepspeed" not in parts and "deepspeed.py" not in parts, f


def test_the_hook_costs_nothing_without_the_variable_and_imports_no_torch_with_it():
    off, _ = _python(
        """
        import json, sys
        print(json.dumps([m for m in ("_zerotron_startup", "zerotron", "torch") if m in sys.modules]))
    """,
        timeout=60,
    )
    assert off == []
    on, _ = _python(
        """
        import json, sys
        print(json.dumps([m for m in ("_zerotron_startup", "zerotron", "torch") if m in sys.modules]))
    """,
        timeout=60,
        ZEROTRON_AS_DEEPSPEED="1",
    )
    assert on == ["_zerotron_startup"]  # zerotron and torch wait for the first lookup of deepspeed
    zero, _ = _python(
        "import json, sys; print(json.dumps('_zerotron_startup' in sys.modules))", timeout=60, ZEROTRON_AS_DEEPSPEED="0"
    )
    assert zero is False


# ---- without the alias ----------------------------------------------------------------------------


def test_import_zerotron_adds_only_its_path_finders_and_no_deepspeed():
    real = _real_deepspeed_installed()
    result, _ = _python("""
        import importlib.metadata, importlib.util, json, sys
        before = list(sys.meta_path)
        import zerotron
        added = [(sys.meta_path.index(f), type(f).__module__, type(f).__name__)
                 for f in sys.meta_path if f not in before]
        kept = [f for f in sys.meta_path if f in before] == before
        spec = importlib.util.find_spec("deepspeed")
        try:
            import deepspeed
            imported = deepspeed.__name__
        except ImportError as e:
            imported = "ImportError: " + str(e)
        try:
            version = importlib.metadata.version("deepspeed")
        except importlib.metadata.PackageNotFoundError:
            version = None
        print(json.dumps({"added": added, "n": len(sys.meta_path), "kept": kept, "spec": spec is not None,
                          "imported": imported, "version": version}))
    """)
    assert result["kept"]
    assert result["added"] == [
        [0, "zerotron.compat.alias", "_Aliases"],
        [result["n"] - 1, "zerotron.compat.alias", "_PathTable"],
    ]
    if real:
        assert result["imported"] == "deepspeed" and result["version"] and "zerotron" not in result["version"]
    else:
        assert not result["spec"]
        assert result["imported"] == "ImportError: No module named 'deepspeed'"
        assert result["version"] is None


def test_renamed_paths_and_attribute_chains_without_importing_them():
    """`import zerotron as deepspeed`: DeepSpeed's attribute chains and (rewritten) import lines."""
    result, _ = _python("""
        import json, sys
        import zerotron as deepspeed
        acc = deepspeed.accelerator.get_accelerator()
        status = deepspeed.runtime.zero.partition_parameters.ZeroParamStatus
        logger = deepspeed.utils.logger
        from zerotron.utils import RepeatingLoader
        import zerotron.runtime.zero.partition_parameters as pp
        import zerotron.compat.runtime.zero.partition_parameters as real_pp
        import zerotron.compat.accelerator, zerotron.compat.utils
        print(json.dumps({
            "acc": acc is zerotron.compat.accelerator.get_accelerator(),
            "status": status is real_pp.ZeroParamStatus, "pp": pp is real_pp,
            "entries": sys.modules["zerotron.runtime.zero.partition_parameters"] is real_pp,
            "names": [pp.__name__, pp.__spec__.name, sys.modules["zerotron.utils"].__spec__.name],
            "logger": logger is zerotron.compat.utils.logger,
            "loader": RepeatingLoader is zerotron.compat.utils.RepeatingLoader,
            "top": [getattr(deepspeed, n) is getattr(deepspeed, n) for n in ("get_accelerator", "logger")],
            "version": deepspeed.__version__,
            "dir": "get_accelerator" in dir(deepspeed) and "runtime" in dir(deepspeed),
        }))
    """)
    assert result.pop("names") == ["zerotron.compat.runtime.zero.partition_parameters"] * 2 + ["zerotron.compat.utils"]
    assert result.pop("version") != "" and all(v is True or v == [True, True] for v in result.values()), result


def test_a_table_entry_whose_target_is_missing_is_a_clear_import_error():
    result, _ = _python("""
        import json, zerotron
        from zerotron.compat import paths
        paths.PATHS["nowhere"] = "zerotron.compat.nowhere"
        paths.PATHS["nowhere.deeper"] = "zerotron.compat.nowhere"
        try:
            import zerotron.nowhere
            message = None
        except ModuleNotFoundError as e:
            message, name = str(e), e.name
        try:
            zerotron.nowhere
            attr = None
        except AttributeError as e:
            attr = str(e)
        print(json.dumps({"message": message, "name": name, "attr": attr}))
    """)
    assert result["name"] == "zerotron.nowhere"
    assert "zerotron/compat/paths.py maps it to 'zerotron.compat.nowhere'" in result["message"]
    assert "No module named 'zerotron.compat.nowhere'" in result["message"]
    assert result["attr"] and "zerotron.compat.nowhere" in result["attr"]


# ---- the alias --------------------------------------------------------------------------------------

ALIAS_CHECKS = """
    import importlib.metadata, importlib.util, json, sys, warnings
    found = importlib.util.find_spec("deepspeed") is not None   # how transformers/accelerate/TRL look first
    version = importlib.metadata.version("deepspeed")           # ... and gate their features
    name = importlib.metadata.metadata("deepspeed")["Name"]
    import deepspeed
    import zerotron, zerotron.ops.adam, zerotron.zero, zerotron.pipe, zerotron.checkpointing
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    from deepspeed.ops.adam.cpu_adam import DeepSpeedCPUAdam as cpu_adam
    import deepspeed.ops.adam.fused_adam
    from deepspeed import comm as dist, zero, checkpointing
    from deepspeed.pipe import PipelineModule
    import deepspeed.zero
    print(json.dumps({
        "found": found, "version": version, "name": name,
        "expected": "0.18.0+zerotron." + zerotron.__version__,
        "identity": [deepspeed is zerotron, DeepSpeedCPUAdam is zerotron.ops.adam.DeepSpeedCPUAdam,
                     cpu_adam is DeepSpeedCPUAdam, deepspeed.ops.adam.fused_adam is zerotron.ops.adam,
                     sys.modules["deepspeed.ops.adam.cpu_adam"] is zerotron.ops.adam,
                     dist is zerotron.comm, zero is zerotron.zero, sys.modules["deepspeed.zero"] is zerotron.zero,
                     checkpointing is zerotron.checkpointing, PipelineModule is zerotron.pipe.PipelineModule,
                     sys.modules["deepspeed"] is zerotron, sys.modules["deepspeed.pipe"] is zerotron.pipe],
        "specs": [zerotron.__spec__.name, zerotron.ops.adam.__spec__.name, deepspeed.__name__],
        "file": deepspeed.__file__,
        "dists": importlib.metadata.packages_distributions().get("deepspeed"),
    }))
"""


def _check_alias(result):
    assert result["found"] and result["name"] == "deepspeed"
    assert result["version"] == result["expected"]
    assert all(result["identity"]), result["identity"]
    assert result["specs"] == ["zerotron", "zerotron.ops.adam", "zerotron"]
    assert result["file"].endswith(os.path.join("zerotron", "__init__.py"))
    # (listed twice where the real DeepSpeed is installed too, as on a benchmark machine)
    assert set(result["dists"]) == {"deepspeed"}


def test_the_environment_variable_aliases_deepspeed_from_interpreter_start():
    result, out = _python(ALIAS_CHECKS, ZEROTRON_AS_DEEPSPEED="1")
    _check_alias(result)
    if not _real_deepspeed_installed():
        assert "Warning" not in out.stderr, out.stderr


def test_as_deepspeed_at_run_time():
    result, _ = _python("""
        import importlib.util, json, sys, warnings
        import zerotron
        before = importlib.util.find_spec("deepspeed")
        n = len(sys.meta_path)
        assert zerotron.as_deepspeed() is zerotron
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            zerotron.as_deepspeed()   # again: nothing more, and no warning
        print(json.dumps({"before": before is None, "same": len(sys.meta_path) == n,
                          "first": type(sys.meta_path[0]).__name__}))
    """)
    assert result["same"] and result["first"] == "_Aliases"
    assert result["before"] or _real_deepspeed_installed()
    result, _ = _python("import zerotron; zerotron.as_deepspeed()\n" + textwrap.dedent(ALIAS_CHECKS))
    _check_alias(result)


def test_every_path_in_the_table_is_its_target_under_both_names():
    """The table test: each DeepSpeed path imports as `deepspeed.<path>` and as `zerotron.<path>`,
    is its target module (one object: sys.modules entries and attribute chains agree), and no
    zerotron file is loaded twice. Runs over the whole table: a target someone has not built yet
    fails here, by design."""
    result, _ = _python(
        """
        import functools, importlib, json, os, sys, traceback
        import zerotron
        from zerotron.compat import paths
        zerotron.as_deepspeed()
        import deepspeed
        problems = []
        for path, target in paths.PATHS.items():
            try:
                module = importlib.import_module(target)
                assert module.__name__ == target and module.__spec__.name == target, "target is not a real module name"
                assert importlib.import_module("deepspeed." + path) is module, "deepspeed.<path> is another object"
                assert sys.modules["deepspeed." + path] is module
                assert functools.reduce(getattr, path.split("."), deepspeed) is module, "attribute chain differs"
                assert paths.resolve(path) == target
                # zerotron.<path>: Python refuses a path below a plain (non-package) real module before
                # asking any finder; everywhere else it must be the same object
                parts = path.split(".")
                plain = [".".join(parts[:i]) for i in range(1, len(parts))
                         if paths.resolve(".".join(parts[:i])) == "zerotron." + ".".join(parts[:i])
                         and not hasattr(importlib.import_module("zerotron." + ".".join(parts[:i])), "__path__")]
                if plain and "zerotron." + path not in sys.modules:
                    try:
                        importlib.import_module("zerotron." + path)
                        raise AssertionError("imported below a plain module?")
                    except ModuleNotFoundError as e:
                        assert "is not a package" in str(e), e
                else:
                    assert importlib.import_module("zerotron." + path) is module, "zerotron.<path> is another object"
                    assert functools.reduce(getattr, path.split("."), zerotron) is module
            except Exception as e:
                problems.append(f"{path} -> {target}: {type(e).__name__}: {e}")
        for name, (path, attr) in paths.NAMES.items():
            try:
                value = getattr(importlib.import_module(paths.resolve(path)), attr)
                assert getattr(zerotron, name) is value and getattr(deepspeed, name) is value
            except Exception as e:
                problems.append(f"deepspeed.{name} ({path}.{attr}): {type(e).__name__}: {e}")
        root = os.path.dirname(zerotron.__file__)
        by_file = {}
        for m in list(sys.modules.values()):
            f = getattr(m, "__file__", None) or ""
            if f.startswith(root):
                by_file.setdefault(f, set()).add(id(m))
        twice = sorted(f for f, ids in by_file.items() if len(ids) > 1)
        print(json.dumps({"problems": problems, "twice": twice, "n": len(paths.PATHS)}))
    """,
        timeout=400,
    )
    assert result["problems"] == [], "\n".join(result["problems"])
    assert result["twice"] == []
    assert result["n"] >= 40


def test_a_path_outside_the_table_maps_to_the_same_name_under_zerotron():
    result, _ = _python("""
        import importlib.util, json, sys
        import zerotron
        zerotron.as_deepspeed()
        import deepspeed.checkpoint, zerotron.checkpoint      # not in the table: zerotron's own module
        try:
            import deepspeed.no_such_module
            missing = None
        except ModuleNotFoundError as e:
            missing = str(e)
        print(json.dumps({"same": sys.modules["deepspeed.checkpoint"] is zerotron.checkpoint,
                          "spec": importlib.util.find_spec("deepspeed.no_such_module") is None, "missing": missing}))
    """)
    assert result == {"same": True, "spec": True, "missing": "No module named 'deepspeed.no_such_module'"}


# ---- beside a real DeepSpeed --------------------------------------------------------------------------


def test_a_real_deepspeed_is_left_alone_unless_asked_and_an_imported_one_refuses_the_alias(fake_deepspeed):
    result, _ = _python(
        """
        import importlib.metadata, json
        import zerotron
        import deepspeed
        real = getattr(deepspeed, "REAL", False) and importlib.metadata.version("deepspeed")
        try:
            zerotron.as_deepspeed()
            error = None
        except zerotron.compat.alias.AliasError as e:
            error = str(e)
        import sys
        print(json.dumps({"real": real, "error": error, "still": sys.modules["deepspeed"] is deepspeed,
                          "version": importlib.metadata.version("deepspeed")}))
    """,
        PYTHONPATH=fake_deepspeed,
    )
    assert result["real"] == FAKE_VERSION and result["still"] and result["version"] == FAKE_VERSION
    assert "already imported" in result["error"] and fake_deepspeed in result["error"]


def test_asking_for_the_alias_beside_an_installed_deepspeed_warns_that_it_is_shadowed(fake_deepspeed):
    code = """
        import importlib.metadata, json, sys, warnings
        warnings.simplefilter("always")
        with warnings.catch_warnings(record=True) as caught:
            import zerotron
            zerotron.as_deepspeed()
            import deepspeed
        print(json.dumps({"alias": deepspeed is zerotron, "version": importlib.metadata.version("deepspeed"),
                          "warnings": [f"{w.category.__name__}: {w.message}" for w in caught
                                       if "deepspeed" in str(w.message)]}))
    """
    result, _ = _python(code, PYTHONPATH=fake_deepspeed)
    assert result["alias"] and result["version"].startswith("0.18.0+zerotron.")
    assert len(result["warnings"]) == 1 and result["warnings"][0].startswith("ShadowWarning")
    assert FAKE_VERSION in result["warnings"][0] and fake_deepspeed in result["warnings"][0]
    # the same under the environment variable: the warning goes to stderr at the first lookup
    result, out = _python(
        "import deepspeed, json, zerotron; print(json.dumps(deepspeed is zerotron))",
        PYTHONPATH=fake_deepspeed,
        ZEROTRON_AS_DEEPSPEED="1",
    )
    assert result is True and "ShadowWarning" in out.stderr


def test_a_directory_named_deepspeed_is_no_installed_deepspeed(tmp_path):
    """examples/deepspeed/ (no __init__.py) in the working directory is a namespace package, not a
    DeepSpeed to warn about."""
    (tmp_path / "deepspeed").mkdir()
    (tmp_path / "deepspeed" / "script.py").write_text("")
    code = """
        import json, warnings
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            import zerotron
            zerotron.as_deepspeed()
            import deepspeed
        print(json.dumps({"alias": deepspeed is zerotron, "warnings": [str(w.message) for w in caught
                                                                        if "deepspeed" in str(w.message).lower()]}))
    """
    result, _ = _python(code, cwd=str(tmp_path), PYTHONPATH=str(tmp_path))
    assert result == {"alias": True, "warnings": []}


# ---- zerotron run --as-deepspeed ----------------------------------------------------------------------


def test_zerotron_run_as_deepspeed_aliases_deepspeed_in_the_workers(tmp_path):
    script = tmp_path / "uses_deepspeed.py"
    script.write_text(
        textwrap.dedent("""
        import importlib.metadata, os, sys
        import deepspeed
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        assert deepspeed is sys.modules["zerotron"], deepspeed
        print("alias:", os.environ["RANK"], os.environ["ZEROTRON_AS_DEEPSPEED"],
              importlib.metadata.version("deepspeed"))
    """)
    )
    out = subprocess.run(
        [sys.executable, "-m", "zerotron.cli", "run", "-n", "1", "--as-deepspeed", str(script)],
        cwd=str(tmp_path),
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert "alias: 0 1 0.18.0+zerotron." in out.stdout
