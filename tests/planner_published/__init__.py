"""The planner against published large training runs: runs.py and more_runs.py rebuild 62 of them as the
planner sees them, comparison.py compares its predictions with what they achieved
(`python tests/planner_published/comparison.py` writes bench/results/planner_published.json), and
tests/test_planner_published.py holds the comparison to the bounds docs/planner.md states."""
