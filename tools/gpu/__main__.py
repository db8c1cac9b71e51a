"""`python -m tools.gpu ...` (or `python tools/gpu ...`): the runbook's command line, tools/gpu/run.py."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # `python tools/gpu` puts only this folder on the path
from tools.gpu.run import main  # noqa: E402

sys.exit(main())
