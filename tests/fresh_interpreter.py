"""A fresh Python interpreter for the tests of the import system (test_compat_alias.py,
test_compat_paths.py): the `deepspeed` alias changes sys.meta_path and sys.modules for the whole
process, so each check runs in its own interpreter, with a timeout."""

import json
import os
import subprocess
import sys
import textwrap


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
