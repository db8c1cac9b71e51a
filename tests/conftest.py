import os
import sys

# Tests import their helpers (distributed.py, parity.py) as top-level modules, in this process
# and in the rank processes the fork server starts.
sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("PYTHONPATH", os.path.dirname(__file__))
