"""The first way in, done to a copy: every DeepSpeed import in a tree of Python files rewritten as a user edits it
to run on zerotron without the alias (README, "Two ways in").

    import deepspeed                       ->  import zerotron as deepspeed
    import deepspeed as ds                 ->  import zerotron as ds
    import deepspeed.comm as dist          ->  import zerotron.comm as dist
    import deepspeed.runtime.utils         ->  import zerotron.runtime.utils, zerotron as deepspeed
    from deepspeed.ops.adam import X       ->  from zerotron.ops.adam import X

Only import statements change (found with `ast`, so text in strings and comments is left alone); the code that
uses the name `deepspeed` afterwards is untouched, as it is for a user. `import deepspeed.x` binds the name
`deepspeed`, so its rewrite binds it too.

    python tools/deepspeed_rename.py SRC DST     # copy SRC to DST renamed; prints every edit
"""

from __future__ import annotations

import ast
import os
import sys
from pathlib import Path

OLD, NEW = "deepspeed", "zerotron"


def _ours(module: str | None) -> bool:
    return module is not None and (module == OLD or module.startswith(OLD + "."))


def _alias(name: ast.alias) -> str:
    if not _ours(name.name):
        return name.name + (f" as {name.asname}" if name.asname else "")
    target = NEW + name.name[len(OLD) :]
    if name.asname:
        return f"{target} as {name.asname}"
    if name.name == OLD:
        return f"{NEW} as {OLD}"
    return f"{target}, {NEW} as {OLD}"  # `import deepspeed.x` also binds `deepspeed`


def _column(line: str, offset: int) -> int:
    """ast's column (a UTF-8 byte offset) as a str index."""
    return len(line.encode()[:offset].decode())


def _edits(tree: ast.AST, lines: list[str]) -> list[tuple[int, int, int, str]]:
    """(line index, start column, end column, new text) for each DeepSpeed import."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and _ours(node.module):
            # the module name follows `from` on the statement's first line, however the names are wrapped
            line = node.lineno - 1
            start = lines[line].index(OLD, _column(lines[line], node.col_offset))
            out.append((line, start, start + len(OLD), NEW))
        elif isinstance(node, ast.Import) and any(_ours(n.name) for n in node.names):
            if node.end_lineno != node.lineno:
                raise ValueError(f"line {node.lineno}: an `import` of deepspeed continued over lines: edit it by hand")
            text = "import " + ", ".join(_alias(n) for n in node.names)
            line = lines[node.lineno - 1]
            out.append((node.lineno - 1, _column(line, node.col_offset), _column(line, node.end_col_offset), text))
    return out


def rename_source(text: str) -> tuple[str, list[tuple[int, str, str]]]:
    """`text` with its DeepSpeed imports renamed, and the edits as (line number, old line, new line)."""
    lines = text.splitlines(keepends=True)
    edits = _edits(ast.parse(text), lines)
    before = {line: lines[line] for line, *_ in edits}
    for line, start, end, new in sorted(edits, reverse=True):  # right to left: earlier columns stay valid
        lines[line] = lines[line][:start] + new + lines[line][end:]
    changed = [(line + 1, before[line].rstrip("\n"), lines[line].rstrip("\n")) for line in sorted(before)]
    return "".join(lines), changed


def rename_tree(src: Path, dst: Path) -> list[tuple[str, int, str, str]]:
    """Copy `src` to `dst` with every .py file renamed; directories holding no .py file and other files are
    symlinks to the originals (checkpoints and data stay where they are). Returns (file, line, old, new) per edit.
    A file Python cannot parse is copied as it is, named in the warning printed."""
    edits = []
    dst.mkdir(parents=True, exist_ok=True)
    for entry in sorted(os.scandir(src), key=lambda e: e.name):
        path, into = Path(entry.path), dst / entry.name
        if entry.name == "__pycache__":
            continue
        if entry.is_dir(follow_symlinks=False) and any(p.suffix == ".py" for p in path.rglob("*")):
            edits += [(f"{entry.name}/{f}", *rest) for f, *rest in rename_tree(path, into)]
        elif entry.name.endswith(".py") and entry.is_file():
            text = path.read_text(errors="surrogateescape")
            try:
                new, changed = rename_source(text)
            except SyntaxError as e:
                print(f"deepspeed_rename: {path} is not Python this interpreter parses ({e}); copied unchanged")
                new, changed = text, []
            into.write_text(new, errors="surrogateescape")
            edits += [(entry.name, *c) for c in changed]
        else:
            into.symlink_to(path.resolve())
    return edits


if __name__ == "__main__":
    for file, line, old, new in rename_tree(Path(sys.argv[1]), Path(sys.argv[2])):
        print(f"{file}:{line}: {old.strip()}  ->  {new.strip()}")
