"""DeepSpeed's module paths on zerotron (zerotron/compat/paths.py): what `import zerotron` adds to the
import system, `import zerotron as deepspeed` and its attribute chains, a table entry whose target is
missing, and, with the alias on, every path in the table under both names and a path outside it.

Every check of the import system runs in a fresh interpreter (the alias changes sys.meta_path and
sys.modules for the whole process); each subprocess has a timeout.
"""

from fresh_interpreter import _python, _real_deepspeed_installed

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


def test_a_deepspeed_feature_zerotron_lacks_is_refused_at_import_with_what_to_do_instead():
    """DeepSpeedExamples' variable batch size example imports deepspeed.runtime.data_pipeline...; Domino imports
    deepspeed.runtime.domino: both ways in, the import names the feature and the way instead."""
    result, _ = _python("""
        import json
        import zerotron
        messages = {}
        def attempt(key, statement):
            try:
                exec(statement)
            except ModuleNotFoundError as e:
                messages[key] = [e.name, str(e)]
        attempt("rename", "from zerotron.runtime.data_pipeline.data_sampling import variable_batch_size_and_lr")
        attempt("top", "import zerotron.module_inject")
        zerotron.as_deepspeed()
        attempt("alias", "from deepspeed.runtime.domino.transformer import DominoTransformer")
        import deepspeed.runtime.zero  # (its siblings still resolve)
        print(json.dumps(messages))
    """)
    assert result["rename"][0] == "zerotron.runtime.data_pipeline"
    assert "does not implement DeepSpeed's data efficiency library" in result["rename"][1]
    assert "in your own DataLoader" in result["rename"][1]
    assert result["top"][0] == "zerotron.module_inject" and "kernel injection" in result["top"][1]
    assert result["alias"][0] == "deepspeed.runtime.domino" and "tensor_parallel.autotp_size" in result["alias"][1]
