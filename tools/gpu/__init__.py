"""The one-GPU runbook: `python -m tools.gpu [--out $OUT/gpu.json]`. run.py: the command line and the parent,
which runs each part in a child process under a time limit; parts.py: the `mfu`, `ckpt` and `offload` parts;
checks.py: the `correct` and `sanitized` parts; summary.py: the closing summary. See tools/README.md."""
