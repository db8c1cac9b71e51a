"""The fake-CUDA pass: one short training run of every feature with its tensors on torch's "cuda" device under
CUDA's rules (tools/fake_cuda), on 2 ranks with NCCL's group rules: nothing a GPU would refuse (a host tensor
meeting a device tensor, a CUDA kernel's output shape or layout, CUDA-only kernels' constraints, host tensors
in collectives), the same losses as the same run on the CPU, bit for bit, and no more host syncs per step than
the budget written beside the feature (tests/fake_cuda_features.py). A new feature joins FEATURES."""

import pytest
from distributed import run_ranks
from fake_cuda_features import BY_NAME, FEATURES, run


@pytest.mark.parametrize("name", [f.name for f in FEATURES])
def test_every_feature_trains_under_cudas_rules(name):
    feature = BY_NAME[name]
    on_gpu = run_ranks(run, feature.world, name, fake_cuda=True, timeout=120)
    on_cpu = run_ranks(run, feature.world, name, timeout=120)
    for rank, ((losses, syncs, unchecked), (cpu_losses, _, _)) in enumerate(zip(on_gpu, on_cpu)):
        assert losses == cpu_losses, f"rank {rank}: {losses} on the fake GPU, {cpu_losses} on the CPU"
        assert not unchecked, (
            f"rank {rank}: operations without a meta kernel (only the device rule applied): {unchecked}"
        )
    per_step = [(len(s), rank, i, s) for rank, (_, syncs, _) in enumerate(on_gpu) for i, s in enumerate(syncs) if i]
    most, rank, step, where = max(per_step, key=lambda x: x[0])
    assert most == feature.budget, (
        f"{name}: {most} host syncs in step {step} on rank {rank}, budget {feature.budget} ({feature.why}):\n  "
        + "\n  ".join(where)
    )
