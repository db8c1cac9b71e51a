"""Fault harnesses, run by tests/test_faults.py (short) and by hand (long): soak.py (many short jobs, one
random fault each, of soak_job.py) and exits.py (consecutive finished jobs must exit 0)."""
