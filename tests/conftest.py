import os
import sys

# Tests import their helpers (distributed.py, parity.py) as top-level modules, and bench/'s
# pieces they share (bench.common, bench.soak) from the repository root, in this process and in
# the rank processes the fork server starts.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("PYTHONPATH", os.path.dirname(__file__))
# Every test runs with NCCL's rules on gloo (zerotron/comm/core.py: one work per point-to-point batch,
# outputs valid only after wait(), no host tensors in collectives).
os.environ.setdefault("ZEROTRON_STRICT_COMM", "1")
