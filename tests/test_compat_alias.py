"""The opt-in `deepspeed` alias (zerotron/compat/alias.py): the start-up hook setup.py installs,
ZEROTRON_AS_DEEPSPEED and zerotron.as_deepspeed(), a real DeepSpeed beside zerotron, and
`zerotron run --as-deepspeed`. (DeepSpeed's module paths on zerotron: test_compat_paths.py.)

Every check of the import system runs in a fresh interpreter (the alias changes sys.meta_path and
sys.modules for the whole process); each subprocess has a timeout.
"""

import ast
import os
import subprocess
import sys
import textwrap

import pytest
from fresh_interpreter import _env, _python, _real_deepspeed_installed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAKE_VERSION = "0.14.0"


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
        "expected": "0.18.2+zerotron." + zerotron.__version__,
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
    assert result["alias"] and result["version"].startswith("0.18.2+zerotron.")
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
        import argparse, importlib.metadata, os, sys
        import deepspeed
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        assert deepspeed is sys.modules["zerotron"], deepspeed
        p = argparse.ArgumentParser()
        p.add_argument("--local_rank", type=int, default=-1)  # DeepSpeed's launcher passes it
        p.add_argument("--steps", type=int)
        args = p.parse_args()
        print("alias:", os.environ["RANK"], os.environ["ZEROTRON_AS_DEEPSPEED"],
              importlib.metadata.version("deepspeed"), "local_rank", args.local_rank, "steps", args.steps,
              "main", __name__, "path", os.path.dirname(__file__) in sys.path)
    """)
    )
    out = subprocess.run(
        [sys.executable, "-m", "zerotron.cli", "run", "-n", "2", "--as-deepspeed", str(script), "--steps", "3"],
        cwd=str(tmp_path),
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    for rank in (0, 1):  # DeepSpeed's launcher's --local_rank, before the script's own arguments
        assert f"alias: {rank} 1 0.18.2+zerotron." in out.stdout
        assert f"local_rank {rank} steps 3 main __main__ path True" in out.stdout
