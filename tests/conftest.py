import os
import sys

# Tests import their helpers (distributed.py, parity.py, fuzz.py, hf_families.py, config_helpers.py,
# scheduler_cases.py, fresh_interpreter.py, the faults/ and planner_published/ packages)
# as top-level modules, and what they share with the GPU runbook (tools.fake_cuda, tools.processes)
# from the repository root, in this process and in the rank processes the fork server starts. No
# test imports bench/ (tests/test_layering.py holds that).
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("PYTHONPATH", os.path.dirname(__file__))
# Every test runs with NCCL's rules on gloo (zerotron/comm/core.py: one work per point-to-point batch,
# outputs valid only after wait(), no host tensors in collectives).
os.environ.setdefault("ZEROTRON_STRICT_COMM", "1")
