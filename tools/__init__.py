"""Tools that run zerotron without being part of it: the GPU runbook (tools/gpu/), the DeepSpeed config
survey, and the helpers the benchmarks (bench/), the runbook and the tests share; see tools/README.md."""
