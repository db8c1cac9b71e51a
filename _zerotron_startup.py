"""zerotron's start-up hook for ZEROTRON_AS_DEEPSPEED=1 (see zerotron/compat/alias.py).

`zerotron-startup.pth`, which zerotron's wheel (and its editable install) puts in site-packages,
imports this module at interpreter start only when ZEROTRON_AS_DEEPSPEED is set. It imports nothing
but `sys`: it puts a finder at the front of sys.meta_path that waits for the first lookup of
`deepspeed` -- an import, `importlib.util.find_spec("deepspeed")` or
`importlib.metadata.version("deepspeed")` -- and only then imports zerotron (and torch), turns the
alias on with `zerotron.as_deepspeed()`, steps aside and answers that lookup from the alias.
A process that never asks for deepspeed pays for nothing but this file.
"""

import sys


def _is_deepspeed(name):
    return name == "deepspeed" or name.startswith("deepspeed.")


class ZerotronStartupFinder:
    _busy = False

    def _activate(self):
        """Turn the alias on; False if that is already under way in this call chain."""
        if self._busy:
            return False
        self._busy = True
        try:
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            import zerotron

            zerotron.as_deepspeed()
        finally:
            self._busy = False
        return True

    def find_spec(self, name, path=None, target=None):
        if not _is_deepspeed(name) or not self._activate():
            return None
        return sys.modules["zerotron.compat.alias"]._aliases.find_spec(name, path, target)

    def find_distributions(self, context=None):
        name = getattr(context, "name", None)
        if name is None or name.replace("_", "-").replace(".", "-").lower() != "deepspeed" or not self._activate():
            return iter(())
        return sys.modules["zerotron.compat.alias"]._aliases.find_distributions(context)


sys.meta_path.insert(0, ZerotronStartupFinder())
