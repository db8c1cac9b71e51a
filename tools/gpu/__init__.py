"""The one-GPU runbook: `python -m tools.gpu [--out $OUT/gpu.json]` (run.py: the parts, each in a child
process under a time limit; checks.py: the `correct` part). See tools/README.md."""
