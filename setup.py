"""Packaging beyond pyproject.toml: the start-up hook's `zerotron-startup.pth`, written to the root of
site-packages by both a regular wheel and a PEP 660 editable install (zerotron/compat/alias.py).

Its one line costs a dictionary lookup at every interpreter start; only when ZEROTRON_AS_DEEPSPEED is
set does it import `_zerotron_startup` (stdlib only), which waits for the first lookup of `deepspeed`.
"""

import os

from setuptools import Command, setup
from setuptools.command.build import build

PTH_NAME = "zerotron-startup.pth"  # sorts after setuptools' "__editable__.*.pth", which must run first
PTH_LINE = (
    'import os; os.environ.get("ZEROTRON_AS_DEEPSPEED", "").strip().lower() in '
    '("", "0", "false", "no", "off") or __import__("_zerotron_startup")\n'
)


class build_startup_hook(Command):
    """Write the .pth where the wheel's root is assembled: `build_lib` for a regular wheel; for an
    editable wheel the directory setuptools' editable_wheel points `install` at (the unpacked
    wheel), because an editable wheel does not take build_lib's files."""

    description = "write zerotron's start-up hook .pth"
    user_options = []

    def initialize_options(self):
        self.build_lib = None
        self.editable_mode = False  # set by setuptools' editable_wheel

    def finalize_options(self):
        self.set_undefined_options("build_py", ("build_lib", "build_lib"))

    def _root(self):
        return self.get_finalized_command("install").install_lib if self.editable_mode else self.build_lib

    def run(self):
        os.makedirs(self._root(), exist_ok=True)
        with open(os.path.join(self._root(), PTH_NAME), "w", encoding="utf-8") as f:
            f.write(PTH_LINE)

    def get_outputs(self):
        return [] if self.editable_mode else [os.path.join(self.build_lib, PTH_NAME)]


class build_with_startup_hook(build):
    sub_commands = [*build.sub_commands, ("build_startup_hook", None)]


setup(cmdclass={"build": build_with_startup_hook, "build_startup_hook": build_startup_hook})
