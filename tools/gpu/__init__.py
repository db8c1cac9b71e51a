"""The one-GPU runbook: `python -m tools.gpu [--out $OUT/gpu.json]`. run.py: the command line and the parent,
which runs each part in a child process under a time limit; parts.py: a child's entry point (child_main);
throughput.py: the `mfu` and `ckpt` parts; offload.py: the `offload` and `offload_off` parts; device.py: the device,
model and log every part uses; sizing.py: the offload part's arithmetic; checks.py: the `correct` and `sanitized`
parts; summary.py: the closing summary. See tools/README.md."""
