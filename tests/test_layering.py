"""The package's structure, held to what docs/design.md says: imports run one way (config ->
topology/comm -> parallelize -> engine -> integrations) with no circles between its files and
folders, the DeepSpeed/Hugging Face compatibility surface (zerotron/compat) is imported by no
core module, every ZeRO stage's model states present the ModelStates interface, and no Python file
of the repository is over 400 lines. Around the package: bench/ holds side-by-side comparisons only
(no test and no tool imports it, and it stays a small part of the code), tools/ and tests/ hold the
rest."""

import ast
import collections
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "zerotron"
REPO = PACKAGE.parent
MAX_LINES = 400
BENCH_SHARE = 0.15  # bench/'s lines over the non-test code's (zerotron, examples, bench, tools)


def _modules():
    out = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
        out[name] = path
    return out


def _imports(name, path, modules):
    """zerotron modules `name` imports anywhere in its code (function-level imports included)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(max(node.level - 1, 0)):
                base = base.rsplit(".", 1)[0]
            full = (base + ("." + node.module if node.module else "")) if node.level else (node.module or "")
            targets = [full + "." + a.name for a in node.names] + [full]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in modules and "." in t:
                t = t.rsplit(".", 1)[0]
            if t in modules and t.startswith("zerotron"):
                found.add(t)
                break
    return found


def _room(module):
    """A top-level file or sub-package of zerotron (what the layering is about)."""
    parts = module.split(".")
    return "zerotron" if len(parts) == 1 else ".".join(parts[:2])


def _room_graph():
    modules = _modules()
    edges = collections.defaultdict(set)
    for name, path in modules.items():
        for target in _imports(name, path, modules):
            if _room(target) != _room(name):
                edges[_room(name)].add(_room(target))
    return edges


def _cycle(edges):
    state, stack = {}, []

    def visit(v):
        state[v] = "open"
        stack.append(v)
        for w in sorted(edges.get(v, ())):
            if state.get(w) == "open":
                return stack[stack.index(w) :] + [w]
            if w not in state:
                found = visit(w)
                if found:
                    return found
        state[v] = "done"
        stack.pop()
        return None

    for v in sorted(edges):
        if v not in state:
            found = visit(v)
            if found:
                return found
    return None


def test_imports_run_one_way():
    assert _cycle(_room_graph()) is None, f"an import circle: {' -> '.join(_cycle(_room_graph()))}"


def test_the_compatibility_edge_is_imported_by_no_core_module():
    edges = _room_graph()
    top = {"zerotron", "zerotron.cli", "zerotron.train", "zerotron.compat"}  # the package face and the commands
    offenders = sorted(room for room, targets in edges.items() if "zerotron.compat" in targets and room not in top)
    assert not offenders, f"core modules importing zerotron.compat: {offenders}"


def test_config_imports_only_its_own_tables_errors_and_warnings():
    modules = _modules()
    allowed = {
        "zerotron.errors",
        "zerotron.optim",  # (the optimizer section's own checks)
        "zerotron.log",
    }  # (warnings attributed to the user's line)
    for name in [m for m in modules if m == "zerotron.config" or m.startswith("zerotron.config.")]:
        outside = {m for m in _imports(name, modules[name], modules) if not m.startswith("zerotron.config")}
        assert outside <= allowed, (name, outside - allowed)


def _assigned_in_init(cls) -> set[str]:
    """Attributes `self.X = ...` that __init__ of `cls` or of a base assigns."""
    import inspect
    import textwrap

    names = set()
    for klass in cls.__mro__:
        init = vars(klass).get("__init__")
        if init is None or not hasattr(init, "__code__"):
            continue
        for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(init)))):
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, (ast.AnnAssign, ast.AugAssign))
                else []
            )
            for t in targets:
                for el in t.elts if isinstance(t, ast.Tuple) else [t]:
                    if isinstance(el, ast.Attribute) and isinstance(el.value, ast.Name) and el.value.id == "self":
                        names.add(el.attr)
    return names


def test_every_stage_presents_the_model_states_interface():
    import inspect

    from zerotron.zero.replicated import ReplicatedStates
    from zerotron.zero.sharded import ShardedStates
    from zerotron.zero.stage3 import Stage3States
    from zerotron.zero.strategy import MEMBERS, ModelStates

    methods = {n for n, v in vars(ModelStates).items() if inspect.isfunction(v) and not n.startswith("_")}
    attributes = set(ModelStates.__annotations__)
    assert methods | attributes == set(MEMBERS)
    for cls in (ReplicatedStates, ShardedStates, Stage3States):
        missing = [m for m in methods if not inspect.isfunction(getattr(cls, m, None))]
        missing += [a for a in attributes if not hasattr(cls, a) and a not in _assigned_in_init(cls)]
        assert not missing, f"{cls.__name__} lacks {missing}"


def test_no_file_is_over_400_lines():
    """Every Python file of the repository: the package, its tests, benchmarks, tools and examples."""
    root = PACKAGE.parent
    files = [p for top in ("zerotron", "tests", "bench", "tools", "examples") for p in (root / top).rglob("*.py")]
    long = {str(p.relative_to(root)): n for p in files if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split these files: {long}"


def test_a_split_head_goes_only_to_a_model_that_takes_its_loss():
    """The vocabulary-split head's loss must replace the model's own, or the model would train
    on split logits; a model with nowhere to take it is refused with the fix."""
    import pytest
    import torch.nn as nn

    from zerotron.errors import ConfigError
    from zerotron.parallelize import adapter_for
    from zerotron.tensor_parallel.tensor import SplitHead

    head = SplitHead(loss_fn=object(), output_fn=object())
    with pytest.raises(ConfigError, match="column_gathered"):
        adapter_for(nn.Linear(2, 2)).use_split_head(nn.Linear(2, 2), head)
    from zerotron.models.gpt import GPT, config_for

    model = GPT(config_for("tiny"))
    adapter_for(model).use_split_head(model, head)
    assert model.loss_fn is head.loss_fn and model.output_fn is head.output_fn


# An import of bench anywhere in a file, code or a script it runs (`from bench...`, `import bench`).
_IMPORTS_BENCH = re.compile(r"^\s*(from\s+bench(\.\w+)*\s+import|import\s+bench\b)", re.M)


def test_nothing_but_a_benchmark_imports_bench():
    """What a test or a tool needs from a benchmark belongs in tools/ (shared) or tests/ (fault
    harnesses, the planner's published runs); bench/ itself only compares."""
    files = [
        *(REPO / "tests").rglob("*.py"),
        *(REPO / "tools").rglob("*.py"),
        *PACKAGE.rglob("*.py"),
        *(REPO / "examples").rglob("*.py"),
    ]
    importers = sorted(str(p.relative_to(REPO)) for p in files if _IMPORTS_BENCH.search(p.read_text()))
    assert not importers, f"these import bench/: {importers}"


def _py_lines(folder: str) -> int:
    return sum(len(p.read_text().splitlines()) for p in (REPO / folder).rglob("*.py"))


def test_bench_stays_a_small_part_of_the_code():
    lines = {folder: _py_lines(folder) for folder in ("zerotron", "examples", "bench", "tools")}
    share = lines["bench"] / sum(lines.values())
    assert share <= BENCH_SHARE, f"bench/ is {share:.1%} of the non-test code ({lines}): move what is not a comparison"
