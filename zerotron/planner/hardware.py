"""Hardware as the planner sees it: per-GPU memory and compute, and the links between GPUs.

Bandwidths are what a collective achieves (NCCL's "bus bandwidth"), per GPU, not the datasheet's
bidirectional link totals: within a node about 80% of the one-way NVLink bandwidth; between
nodes about 90% of one InfiniBand NIC per GPU (DGX layouts: 8 GPUs, 8 NICs). Peak FLOP/s is the
dense bf16 figure; `efficiency` is the fraction of it a whole training step reaches on wide
layers, and `knee` the width (hidden / tp) at which that halves. The GPU efficiencies were set
once, before comparing with published runs, and not tuned to them (docs/planner.md has the
comparison); the CPU row is measured. Host CPU Adam throughput per GPU is an assumption.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

GIB = 2**30


@dataclass(frozen=True)
class Hardware:
    name: str
    memory_gib: float  # per GPU
    peak_tflops: float  # dense bf16 (fp32 on CPUs)
    hbm_gbps: float  # device memory bandwidth, GB/s (the optimizer step is bound by it)
    intra_gbps: float  # collective bus bandwidth inside a node, per GPU
    inter_gbps: float  # ... across nodes, per GPU (one NIC each)
    intra_latency_us: float  # per ring step
    inter_latency_us: float
    pcie_gbps: float  # host <-> device, per GPU (offload)
    host_gib: float  # host memory per node
    gpus_per_node: int = 8
    efficiency: float = 0.6  # fraction of peak the model's matmuls reach
    knee: int = 128  # width (hidden / tp) at which that fraction halves
    host_adam_gparams: float = 1.0  # CPU Adam updates per second per GPU's share of the host, 1e9
    reserve_gib: float = 2.0  # runtime, NCCL buffers, allocator slack
    overlap: float = 1.0  # fraction of a collective's time that compute running beside it hides
    # (GPUs: NCCL has SMs of its own; a CPU's gloo takes cores from compute)

    @property
    def peak_flops(self) -> float:
        return self.peak_tflops * 1e12

    def with_overrides(self, **values) -> "Hardware":
        names = {f.name for f in fields(self)}
        unknown = set(values) - names
        if unknown:
            raise ValueError(f"unknown hardware field(s) {', '.join(sorted(unknown))}; use {', '.join(sorted(names))}")
        return replace(self, **{k: v for k, v in values.items() if v is not None})


# Datasheet figures (NVIDIA A100/H100/H200 SXM; DGX A100 and DGX H100 nodes).
PRESETS = {
    "a100-40": Hardware("a100-40", 40, 312, 1555, 240, 22, 8, 15, 24, 1024, efficiency=0.62),
    "a100-80": Hardware("a100-80", 80, 312, 2039, 240, 22, 8, 15, 24, 2048, efficiency=0.62),
    "h100": Hardware("h100", 80, 989, 3350, 360, 45, 8, 15, 50, 2048, efficiency=0.50),
    "h200": Hardware("h200", 141, 989, 4800, 360, 45, 8, 15, 50, 2048, efficiency=0.50),
    # The build machine (2 cores, gloo over loopback; one core per rank), as bench/planner.py and
    # bench/cpu_adam.py measured it: "GPU memory" is the host's.
    # overlap: the median of 11 calibrations on the shared machine, which ranged from 0 to 1 (noise)
    "cpu": Hardware(
        "cpu",
        24,
        0.061,
        16,
        0.65,
        0.65,
        1255,
        1255,
        1000,
        24,
        gpus_per_node=2,
        efficiency=0.65,
        knee=1,
        host_adam_gparams=0.47,
        reserve_gib=1.0,
        overlap=0.1,
    ),
}


# Dense bf16 peak FLOP/s by the name CUDA reports, for MFU: the presets' figures, and GPUs without a preset.
_PEAK_BY_DEVICE_NAME = {
    "H100": PRESETS["h100"].peak_flops,
    "H200": PRESETS["h200"].peak_flops,
    "A100": PRESETS["a100-80"].peak_flops,
    "L40S": 362e12,
    "A10G": 125e12,
}


def peak_flops_of(device_name: str) -> float | None:
    return next((v for k, v in _PEAK_BY_DEVICE_NAME.items() if k in device_name), None)


def hardware(name: str, **overrides) -> Hardware:
    if name not in PRESETS:
        raise ValueError(f"unknown hardware {name!r}; choose one of {', '.join(PRESETS)} (and override fields)")
    return PRESETS[name].with_overrides(**overrides)


def this_machine(ranks_per_node: int) -> Hardware:
    """The hardware the job runs on: a GPU by the name CUDA reports (its preset, or the H100's with this GPU's
    peak), with the memory it really has; on CPUs the measured CPU row with the host's available memory shared by
    the node's ranks."""
    import os

    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        preset = next((h for h in PRESETS.values() if h.name[:4] in props.name.lower()), PRESETS["h100"])
        peak = peak_flops_of(props.name)
        return preset.with_overrides(
            memory_gib=props.total_memory / GIB, peak_tflops=peak / 1e12 if peak else None, gpus_per_node=ranks_per_node
        )
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
    free = _available_gib() or host  # (the host is shared: what the other processes leave)
    return PRESETS["cpu"].with_overrides(memory_gib=free / ranks_per_node, host_gib=host, gpus_per_node=ranks_per_node)


def _available_gib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 / GIB for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None
