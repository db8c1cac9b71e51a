"""DeepSpeed's own unit tests, run twice: under real DeepSpeed and under zerotron through the alias.

    python -m tools.deepspeed_unit_tests select --python DS_PY --out sel.json unit/runtime unit/checkpoint ...
    python -m tools.deepspeed_unit_tests run --python DS_PY --select sel.json --out ds.json
    python -m tools.deepspeed_unit_tests run --python ZT_PY --alias --select sel.json --out zt.json
    python -m tools.deepspeed_unit_tests compare --deepspeed ds.json --zerotron zt.json [--causes]

`select` collects the test ids with DeepSpeed's interpreter (a file that does not import there is left out)
and keeps at most --per-function parametrizations of each test function, spread over its list, so that a
measurement fits a shared CPU. `run` runs them file by file (a fresh pytest per file, DS_ACCELERATOR=cpu,
OMP_NUM_THREADS=1, pytest-timeout and DeepSpeed's own DS_UNITTEST_TIMEOUT at --timeout seconds), records
passed / failed / error / skipped per test id, and "hang" for a test that was running when its file's run was
stopped: the file then runs again without the tests already answered. `--alias` sets ZEROTRON_AS_DEEPSPEED=1, so
that `import deepspeed` in the tests (and in the ranks they spawn) is zerotron. Results are written after every
file, and a run given an existing --out goes on from where it stopped. `compare` prints, by directory, the
files importable on each side and the tests passing on DeepSpeed and on zerotron, and with --causes the tests
passing on DeepSpeed but not on zerotron grouped by their error's last line.

DeepSpeed's tests are read from --source (default /work/ds-src/tests) and run from a copy (--workdir), never in
place. The plugin that records the events is tools/deepspeed_unit_plugin.py.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from tools.processes import child_env, run_limited

HERE = Path(__file__).resolve().parent
DEFAULT_SOURCE = "/work/ds-src/tests"
DEFAULT_WORKDIR = os.path.join(tempfile.gettempdir(), "deepspeed_unit_tests")
PASSED = "passed"


# ---- running pytest under one interpreter -------------------------------------------------------------------
def _tests_copy(source: str, workdir: str) -> Path:
    """DeepSpeed's tests directory, copied once under `workdir` (pytest writes beside the files it runs)."""
    dest = Path(workdir) / "tests"
    if not dest.exists():
        shutil.copytree(source, dest, ignore=shutil.ignore_patterns("__pycache__"))
    return dest


def _plugin_path(python: str, workdir: str) -> tuple[str, list[str]]:
    """(a PYTHONPATH entry holding the plugin, and pytest-timeout when `python` lacks it; the -p options)."""
    where = Path(workdir) / "plugins"
    where.mkdir(parents=True, exist_ok=True)
    link = where / "deepspeed_unit_plugin.py"
    if not link.exists():
        link.symlink_to(HERE / "deepspeed_unit_plugin.py")
    options = ["-p", "deepspeed_unit_plugin"]
    has_timeout = subprocess.run([python, "-c", "import pytest_timeout"], capture_output=True).returncode == 0
    if not has_timeout:  # DeepSpeed's venv has no pytest-timeout: lend it this interpreter's single-file plugin
        import pytest_timeout

        shared = where / "pytest_timeout.py"
        if not shared.exists():
            shared.symlink_to(pytest_timeout.__file__)
        options += ["-p", "pytest_timeout"]
    return str(where), options


def _lend(python: str, lender: str | None, modules: list[str], workdir: str) -> None:
    """Modules DeepSpeed's tests import that come with DeepSpeed's own dependencies (hjson): where `python` lacks
    one, link the lender interpreter's copy beside the plugin (nothing is installed anywhere)."""
    where = Path(workdir) / "plugins"
    for name in modules:
        if lender is None or subprocess.run([python, "-c", f"import {name}"], capture_output=True).returncode == 0:
            continue
        where_is = f"import {name}, os; print(os.path.dirname({name}.__file__))"
        found = subprocess.run([lender, "-c", where_is], capture_output=True, text=True)
        link = where / name
        if found.returncode == 0 and not link.exists():
            link.symlink_to(found.stdout.strip())


def _pytest(python, alias, workdir, targets, select, timeout, log, local_size=2) -> tuple[int | None, str]:
    """One pytest run over `targets`; the events land in `log`. Returns (exit status or None, output tail)."""
    tests = _tests_copy(_pytest.source, workdir)
    plugin_dir, options = _plugin_path(python, workdir)
    env = child_env(
        DS_ACCELERATOR="cpu",
        OMP_NUM_THREADS=1,
        DS_UNITTEST_TIMEOUT=timeout,
        # DeepSpeed's CPU accelerator counts NUMA nodes as devices (1 here) unless its launcher's LOCAL_SIZE says
        # otherwise, and its test harness skips every test needing more ranks than devices.
        LOCAL_SIZE=local_size,
        ZT_DSUT_LOG=log,
        PYTHONPATH=os.pathsep.join(p for p in (plugin_dir, os.environ.get("PYTHONPATH", "")) if p),
    )
    env.pop("ZEROTRON_AS_DEEPSPEED", None)
    if alias:
        env["ZEROTRON_AS_DEEPSPEED"] = "1"
    if select is not None:
        env["ZT_DSUT_SELECT"] = select
    cmd = [python, "-m", "pytest", "-p", "no:cacheprovider", *options, "-q", "--continue-on-collection-errors"]
    cmd += [f"--timeout={timeout + 30}", "--timeout-method=thread", *targets]
    # A file's worst case: every selected test hangs up to pytest-timeout's limit, plus start-up.
    n = max(1, len(open(select).read().split()) if select else 1)
    status, out, err = run_limited(cmd, timeout=n * (timeout + 40) + 120, env=env, cwd=tests)
    return status, (out + err)[-3000:]


_pytest.source = DEFAULT_SOURCE


def _events(log: str) -> list[dict]:
    if not os.path.exists(log):
        return []
    with open(log, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _outcomes(events: list[dict]) -> tuple[dict, set]:
    """({id: {"outcome", "error"}} for the tests pytest answered, {ids started but never answered})."""
    answered: dict[str, dict] = {}
    started = set()
    for e in events:
        if "start" in e:
            started.add(e["start"])
        elif "id" in e:
            outcome = e["outcome"]
            if outcome == "failed" and e["when"] != "call":
                outcome = "error"
            held = answered.get(e["id"])
            if held is None or held["outcome"] == PASSED:  # a failed teardown after a pass is an error
                answered[e["id"]] = {"outcome": outcome, "error": e["error"]}
    return answered, started - set(answered)


# ---- select -------------------------------------------------------------------------------------------------
def _spread(ids: list[str], k: int) -> list[str]:
    """At most k of `ids`, evenly spread (first and last included)."""
    if len(ids) <= k:
        return ids
    if k == 1:
        return ids[:1]
    return [ids[round(i * (len(ids) - 1) / (k - 1))] for i in range(k)]


def select(args) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "collect.jsonl")
        _pytest(args.python, False, args.workdir, ["--collect-only", *args.paths], None, args.timeout, log)
        events = _events(log)
    by_function: dict[str, list[str]] = collections.defaultdict(list)
    for e in events:
        if "collected" in e:
            by_function[e["collected"].split("[")[0]].append(e["collected"])
    files: dict[str, list[str]] = collections.defaultdict(list)
    for function, ids in by_function.items():
        files[function.split("::")[0]] += _spread(ids, args.per_function)
    out = {
        "paths": args.paths,
        "per_function": args.per_function,
        "collected": sum(len(v) for v in by_function.values()),
        "not_importable_on_deepspeed": {e["collect_error"]: e["error"] for e in events if "collect_error" in e},
        "files": dict(sorted(files.items())),
    }
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"{out['collected']} collected, {sum(len(v) for v in files.values())} selected in {len(files)} files")


# ---- run ----------------------------------------------------------------------------------------------------
def _run_file(args, path: str, ids: list[str]) -> dict:
    """{"tests": {id: outcome}, "import_error": text or None} for one file, rerunning past hangs."""
    result: dict = {"tests": {}, "import_error": None}
    remaining = list(ids)
    with tempfile.TemporaryDirectory() as tmp:
        while remaining:
            log, sel = os.path.join(tmp, f"log{len(result['tests'])}.jsonl"), os.path.join(tmp, "select.txt")
            Path(sel).write_text("\n".join(remaining))
            status, tail = _pytest(args.python, args.alias, args.workdir, [path], sel, args.timeout, log, args.ranks)
            events = _events(log)
            errors = [e["error"] for e in events if "collect_error" in e]
            if errors:
                result["import_error"] = errors[0]
                result["tests"].update({i: {"outcome": "import-error", "error": errors[0]} for i in remaining})
                break
            answered, hung = _outcomes(events)
            for i in hung:
                answered[i] = {"outcome": "hang", "error": f"still running when the run stopped (exit {status})"}
            answered = {i: v for i, v in answered.items() if i in remaining}
            if not answered:  # no progress: say so rather than loop
                result["tests"].update({i: {"outcome": "not-run", "error": tail} for i in remaining})
                break
            result["tests"].update(answered)
            remaining = [i for i in remaining if i not in answered]
    return result


def run(args) -> None:
    chosen = json.loads(Path(args.select).read_text())
    _plugin_path(args.python, args.workdir)
    _lend(args.python, args.lend_from, args.lend, args.workdir)
    out_path = Path(args.out)
    done = json.loads(out_path.read_text()) if out_path.exists() else {"python": args.python, "files": {}}
    for path, ids in chosen["files"].items():
        if args.only and not any(s in path for s in args.only):
            continue
        if path in done["files"] and not args.rerun:
            continue
        print(f"{path}: {len(ids)} tests", flush=True)
        done["files"][path] = _run_file(args, path, ids)
        counts = collections.Counter(v["outcome"] for v in done["files"][path]["tests"].values())
        print(f"  {dict(counts)}", flush=True)
        out_path.write_text(json.dumps(done, indent=1))


# ---- compare ------------------------------------------------------------------------------------------------
def _directory(path: str) -> str:
    """unit/runtime/zero/test_x.py -> runtime/zero; unit/runtime/test_x.py -> runtime."""
    return str(Path(path).parent).removeprefix("unit/")


def _cause(error: str) -> str:
    """The grouping key of a failure: its last line that names an exception, addresses and numbers blurred."""
    lines = [line for line in error.splitlines() if re.search(r"\b\w*(Error|Exception|Exit|Failed)\b", line)]
    line = (lines[-1] if lines else (error.splitlines() or [""])[-1]).strip()
    line = re.sub(r"0x[0-9a-f]+", "0x?", line)
    return re.sub(r"/tmp/\S+", "/tmp/...", line)[:220]


def _merged(paths: list[str]) -> dict:
    files: dict = {}
    for p in paths:
        files.update(json.loads(Path(p).read_text())["files"])
    return files


def compare(args) -> None:
    ds, zt = _merged(args.deepspeed), _merged(args.zerotron)
    if args.select:  # only the selected ids (a result file may hold more from an earlier selection)
        chosen = {i for p in args.select for ids in json.loads(Path(p).read_text())["files"].values() for i in ids}
        for side in (ds, zt):
            for result in side.values():
                result["tests"] = {i: v for i, v in result["tests"].items() if i in chosen}
    rows: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    causes: dict[str, list[str]] = collections.defaultdict(list)
    for path in sorted(set(ds) & set(zt)):
        row = rows[_directory(path)]
        row["files"] += 1
        row["files importable on zerotron"] += zt[path]["import_error"] is None
        for test, answer in ds[path]["tests"].items():
            if answer["outcome"] != PASSED:
                continue
            row["passing on DeepSpeed"] += 1
            theirs = zt[path]["tests"].get(test, {"outcome": "not-run", "error": ""})
            if theirs["outcome"] == PASSED:
                row["passing on zerotron"] += 1
            else:
                causes[f"{theirs['outcome']}: {_cause(theirs['error'])}"].append(test)
    total = sum(rows.values(), collections.Counter())
    columns = ["files", "files importable on zerotron", "passing on DeepSpeed", "passing on zerotron"]
    print(f"{'directory':24}" + "".join(f"{c:>30}" for c in columns) + f"{'ratio':>8}")
    for name, row in [*sorted(rows.items()), ("total", total)]:
        ratio = row["passing on zerotron"] / row["passing on DeepSpeed"] if row["passing on DeepSpeed"] else 0.0
        print(f"{name:24}" + "".join(f"{row[c]:>30}" for c in columns) + f"{ratio:>8.2f}")
    if args.causes:
        for cause, tests in sorted(causes.items(), key=lambda kv: -len(kv[1])):
            print(f"\n{len(tests):4}  {cause}")
            for test in tests[: args.examples]:
                print(f"        {test}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", default=DEFAULT_SOURCE, help="DeepSpeed's tests directory (read only)")
    parser.add_argument("--workdir", default=DEFAULT_WORKDIR, help="where the copy of the tests is run")
    parser.add_argument("--timeout", type=int, default=90, help="seconds per test before it counts as a hang")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("select")
    p.add_argument("--python", required=True, help="DeepSpeed's interpreter")
    p.add_argument("--out", required=True)
    p.add_argument("--per-function", type=int, default=3)
    p.add_argument("paths", nargs="+", help="relative to the tests directory, e.g. unit/runtime/zero")
    p = sub.add_parser("run")
    p.add_argument("--python", required=True)
    p.add_argument("--alias", action="store_true", help="ZEROTRON_AS_DEEPSPEED=1: import deepspeed is zerotron")
    p.add_argument("--select", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--only", nargs="*", help="run only the files whose path contains one of these")
    p.add_argument("--rerun", action="store_true", help="run the --only files again even if --out has them")
    p.add_argument("--ranks", type=int, default=2, help="the most ranks a test may spawn (LOCAL_SIZE)")
    p.add_argument("--lend-from", help="an interpreter to lend the --lend modules from (DeepSpeed's)")
    p.add_argument("--lend", nargs="*", default=["hjson"], help="test dependencies DeepSpeed brings")
    p = sub.add_parser("compare")
    p.add_argument("--deepspeed", nargs="+", required=True, help="result files of the DeepSpeed runs")
    p.add_argument("--zerotron", nargs="+", required=True, help="result files of the zerotron runs")
    p.add_argument("--select", nargs="*", help="selection files: count only their test ids")
    p.add_argument("--causes", action="store_true")
    p.add_argument("--examples", type=int, default=3)
    args = parser.parse_args(argv)
    _pytest.source = args.source
    {"select": select, "run": run, "compare": compare}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
