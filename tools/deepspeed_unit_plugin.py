"""The pytest plugin tools/deepspeed_unit_tests.py loads into DeepSpeed's own test runs (either interpreter).

Stdlib and pytest only: it runs under real DeepSpeed's interpreter too, where zerotron is not installed.
Everything goes to the JSON-lines file named by ZT_DSUT_LOG, one line per event, written and flushed as it
happens so that a run killed for a hang still tells which test was running:
  {"collected": nodeid}                    every test collected (before selection)
  {"collect_error": path, "error": text}   a test file that failed to import
  {"start": nodeid}                        a test begins
  {"id": nodeid, "when": ..., "outcome": ..., "error": text}   pytest's report of each phase
ZT_DSUT_SELECT, when set, names a file of node ids (one a line): only those run.
"""

from __future__ import annotations

import json
import os

_LOG = None


def _write(record: dict) -> None:
    global _LOG
    if _LOG is None:
        _LOG = open(os.environ["ZT_DSUT_LOG"], "a", encoding="utf-8")  # noqa: SIM115  (open for the whole run)
    _LOG.write(json.dumps(record) + "\n")
    _LOG.flush()


def _short(longrepr) -> str:
    """The last lines of a failure: the exception, which is what the grouping by cause reads."""
    text = str(longrepr) if longrepr is not None else ""
    return "\n".join(text.strip().splitlines()[-12:])


def pytest_collectreport(report):
    if report.failed:
        _write({"collect_error": report.nodeid, "error": _short(report.longrepr)})


def pytest_collection_modifyitems(config, items):
    for item in items:
        _write({"collected": item.nodeid})
    select = os.environ.get("ZT_DSUT_SELECT")
    if select:
        with open(select, encoding="utf-8") as f:
            wanted = set(f.read().split("\n"))
        items[:] = [item for item in items if item.nodeid in wanted]


def pytest_runtest_logstart(nodeid, location):
    _write({"start": nodeid})


def pytest_runtest_logreport(report):
    if report.when == "call" or report.outcome != "passed":
        error = _short(report.longrepr) if report.outcome != "passed" else ""
        _write({"id": report.nodeid, "when": report.when, "outcome": report.outcome, "error": error})
