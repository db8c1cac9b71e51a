"""DeepSpeed configs written inline in Python and shell scripts, for `tools/config_survey.py --inline`.

Python: every dict display holding one of DeepSpeed's top-level keys (config_survey.DS_KEYS), rebuilt as the
script builds it, statically, within the enclosing function (or module): a name standing for a dict assigned
there is that dict, with the keys that `name["key"] = value` assignments add (from every branch); a key given
by a name takes each string the name is assigned there (one config per choice: DeepSpeed-Chat's fp16/bfloat16
section); a dict unpacked with ** adds its keys; `args.X` is the default of the script's argparse argument X
(defined in the file or beside it), and arithmetic on known values is done. A value the script computes
otherwise (a call, a condition) becomes a stand-in: the default of the field zerotron parses it into, else 1
(the key itself is what the survey classifies). A dict whose only DeepSpeed keys are optimizer/scheduler is a
training checkpoint's, not a config.
Shell: every here-document holding a DeepSpeed key, its $VARIABLES replaced by what the script assigns them
(`VAR=value`, `${N:-default}`), else 1; one that is still not JSON is counted as a template.
"""

from __future__ import annotations

import ast
import dataclasses
import itertools
import json
import operator
import re
import typing

from tools.config_survey import DS_KEYS

MAX_VARIANTS = 4


class _Scope:
    """A function's (or module's) assignments: name -> [dict displays, strings], and name["k"] = v additions."""

    def __init__(self, node: ast.AST, parent: _Scope | None = None):
        self.parent = parent
        self.values: dict[str, list[ast.expr]] = {}
        args = getattr(node, "args", None)  # a function's parameters stand for their defaults
        if args is not None:
            positional = args.posonlyargs + args.args
            for arg, default in zip(positional[len(positional) - len(args.defaults) :], args.defaults):
                self.values[arg.arg] = [default]
            for arg, default in zip(args.kwonlyargs, args.kw_defaults):
                if default is not None:
                    self.values[arg.arg] = [default]
        body = node.body
        self.added: dict[str, list[tuple[ast.expr, ast.expr]]] = {}
        for node in (n for stmt in body for n in _walk_scope(stmt)):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    pairs = [(target, node.value)]
                    if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):  # a, b = x, y
                        pairs = list(zip(target.elts, node.value.elts))
                    for name, value in pairs:
                        if isinstance(name, ast.Name):
                            self.values.setdefault(name.id, []).append(value)
                        elif isinstance(name, ast.Subscript) and isinstance(name.value, ast.Name):
                            self.added.setdefault(name.value.id, []).append((name.slice, value))

    def strings(self, name: str) -> list[str]:
        return [v.value for v in self.values.get(name, []) if isinstance(v, ast.Constant) and isinstance(v.value, str)]

    def constant(self, name: str):
        """The literal a name is assigned here (the first), else in the module; None if none."""
        for v in self.values.get(name, []):
            try:
                return ast.literal_eval(v)
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                continue
        return None if self.parent is None else self.parent.constant(name)


def _walk_scope(node: ast.AST):
    """The nodes of a scope's statement, not those of functions or classes nested in it."""
    yield node
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
        for child in ast.iter_child_nodes(node):
            yield from _walk_scope(child)


def _stand_in(path: str):
    """What a computed value becomes: the default of the zerotron field the key parses into, else 1."""
    from zerotron.config import Config

    cls = Config
    for part in path.split("."):
        if not dataclasses.is_dataclass(cls):
            return 1
        field = {f.name: f for f in dataclasses.fields(cls)}.get(part)
        if field is None:
            return 1
        hint = typing.get_type_hints(cls)[part]
        cls = ([a for a in typing.get_args(hint) if a is not type(None)] or [hint])[0]
    default = field.default if field.default is not dataclasses.MISSING else None
    return 1 if default is None or dataclasses.is_dataclass(cls) else default


def _arg_defaults(tree: ast.AST) -> dict:
    """dest -> default of the script's argparse arguments (store_true: False), for `args.X` values."""
    out = {}
    for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call)):
        if not (isinstance(call.func, ast.Attribute) and call.func.attr == "add_argument"):
            continue
        kw = {k.arg: k.value for k in call.keywords}
        flags = [a.value for a in call.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        long = [f for f in flags if f.startswith("--")] or flags
        dest = kw["dest"].value if isinstance(kw.get("dest"), ast.Constant) else (long or [""])[0].lstrip("-")
        action = kw["action"].value if isinstance(kw.get("action"), ast.Constant) else None
        try:
            default = ast.literal_eval(kw["default"]) if "default" in kw else None
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            default = None
        default = {"store_true": False, "store_false": True}.get(action, default)
        if dest and default is not None:
            out[dest.replace("-", "_")] = default
    return out


class _Builder:
    def __init__(self, scope: _Scope, args: dict):
        self.scope, self.args = scope, args
        self.choices: dict[str, list[tuple]] = {}  # a key given by a name -> the (key, value) pairs it may be

    def value(self, node: ast.expr, path: str, depth: int = 0):
        if isinstance(node, ast.Dict):
            return self.dict(node, path, depth)
        if isinstance(node, ast.Name) and depth < 8:
            dicts = [v for v in self.scope.values.get(node.id, []) if isinstance(v, ast.Dict)]
            if dicts or node.id in self.scope.added:
                out = {}
                for d in dicts:
                    out.update(self.dict(d, path, depth + 1))
                for key, v in self.scope.added.get(node.id, []):
                    if isinstance(key, ast.Constant) and isinstance(key.value, str):
                        out[key.value] = self.value(v, f"{path}.{key.value}".lstrip("."), depth + 1)
                return out
        known = self.known(node)
        return _stand_in(path) if known is None else known

    _OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
            ast.FloorDiv: operator.floordiv, ast.Pow: operator.pow,
            ast.Not: operator.not_, ast.USub: operator.neg}  # fmt: skip

    def known(self, node: ast.expr):
        """The value of a literal, a name assigned one, `args.X` (the script's own default), or arithmetic and
        `not` of those; None when the script computes it otherwise."""
        if isinstance(node, ast.Name):
            return self.scope.constant(node.id)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            return self.args.get(node.attr)
        if isinstance(node, (ast.BinOp, ast.UnaryOp)) and type(node.op) in self._OPS:
            operands = [
                self.known(n) for n in ((node.left, node.right) if isinstance(node, ast.BinOp) else [node.operand])
            ]
            if all(isinstance(v, (int, float, bool)) for v in operands):
                return self._OPS[type(node.op)](*operands)
            return None
        try:
            return ast.literal_eval(node)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return None

    def dict(self, node: ast.Dict, path: str, depth: int) -> dict:
        out = {}
        for key, v in zip(node.keys, node.values):
            if key is None:  # {**other}
                unpacked = self.value(v, path, depth + 1)
                out.update(unpacked if isinstance(unpacked, dict) else {})
                continue
            if isinstance(key, ast.Constant) and isinstance(key.value, str):
                names = [key.value]
            elif isinstance(key, ast.Name) and self.scope.strings(key.id):
                names = self.scope.strings(key.id)
                dicts = [d for d in self.scope.values.get(getattr(v, "id", ""), []) if isinstance(d, ast.Dict)]
                if len(dicts) == len(names) > 1:  # `if fp16: k, v = "fp16", {...} elif ...`: paired by branch
                    self.choices.setdefault(
                        f"{path}.{key.id}", [(n, self.dict(d, "", depth + 1)) for n, d in zip(names, dicts)]
                    )
                else:
                    self.choices.setdefault(f"{path}.{key.id}", [(n, self.value(v, n, depth + 1)) for n in names])
                out[f"\0{path}.{key.id}"] = None  # resolved per variant
                continue
            else:
                continue
            out[key.value] = self.value(v, f"{path}.{key.value}".lstrip("."), depth + 1)
        return out


def _variants(raw: dict, choices: dict[str, list[tuple[str, object]]]) -> list[dict]:
    def resolve(node, pick):
        if not isinstance(node, dict):
            return node
        return dict(pick[k[1:]] if k.startswith("\0") else (k, resolve(v, pick)) for k, v in node.items())

    names = list(choices)
    picks = itertools.islice(itertools.product(*(choices[n] for n in names)), MAX_VARIANTS)
    return [resolve(raw, dict(zip(names, p))) for p in picks]


def python_configs(text: str, neighbours: list[str] = ()) -> list[dict]:
    """The DeepSpeed configs a Python file writes as dict displays (see the module docstring); `neighbours`: the
    other Python files of its directory, where its argparse arguments may be defined."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    args = {}
    for other in neighbours:
        try:
            args.update(_arg_defaults(ast.parse(other)))
        except SyntaxError:
            pass
    out, seen = {}, set()
    args.update(_arg_defaults(tree))
    module = _Scope(tree)
    scopes = [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    for scope_node in scopes:
        scope = module if scope_node is tree else _Scope(scope_node, module)
        for node in (n for stmt in scope_node.body for n in _walk_scope(stmt)):
            keys = {k.value for k in getattr(node, "keys", []) if isinstance(k, ast.Constant)}
            # ("optimizer" alone is also a training checkpoint's key: such a dict is not a config)
            if isinstance(node, ast.Dict) and keys & set(DS_KEYS) - {"optimizer", "scheduler"} and id(node) not in seen:
                seen.add(id(node))
                builder = _Builder(scope, args)
                raw = builder.dict(node, "", 0)
                for variant in _variants(raw, builder.choices):
                    out.setdefault(json.dumps(variant, sort_keys=True), variant)
    return list(out.values())


_SHELL_VAR = re.compile(r"\$\{(\w+)(?::-([^}]*))?\}|\$(\w+)")


def shell_configs(text: str) -> tuple[list[dict], int]:
    """(the here-document configs of a shell script, how many are still not JSON after substitution)."""
    assigned = {}
    for name, value in re.findall(r"^\s*(\w+)=[\"']?([^\"'\s]*)[\"']?\s*$", text, re.M):
        default = re.fullmatch(r"\$\{\w+:-([^}$]*)\}", value)  # VAR=${2:-4}: its default
        if default or "$" not in value:
            assigned[name] = default.group(1) if default else value
    out, templates = [], 0
    for body in re.findall(r"<<\s*[\"']?(\w+)[\"']?[^\n]*\n(.*?)\n\1\s*$", text, re.S | re.M):
        doc = body[1]
        if not any(f'"{k}"' in doc for k in DS_KEYS):
            continue

        def value(m):
            name, default = m.group(1) or m.group(3), m.group(2)
            got = assigned.get(name) or default or "1"
            in_string = m.string[m.string.rfind("\n", 0, m.start()) + 1 : m.start()].count('"') % 2 == 1
            return got if in_string or re.fullmatch(r"-?[\d.e+]+|true|false", got) else f'"{got}"'

        try:
            raw = json.loads(_SHELL_VAR.sub(value, doc))
        except json.JSONDecodeError:
            templates += 1
            continue
        if isinstance(raw, dict):
            out.append(raw)
    return out, templates
