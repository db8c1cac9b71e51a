"""ZeRO-Offload's host step on its own: CPU Adam bit-identical to torch's fused Adam/AdamW (also reading
bf16 gradients with the unscale and clip multipliers, writing the weights over them), what it refuses,
and FusedHostStep measuring the shards as they leave the device and flagging only NaN/Inf."""

import pytest
import torch

from zerotron.ops.adam import CPUAdam, DeepSpeedCPUAdam


# ---- CPU Adam ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("adamw,amsgrad", [(True, False), (False, False), (True, True)])
def test_cpu_adam_is_bit_identical_to_torch_fused(adamw, amsgrad):
    torch.manual_seed(0)
    n = 300_007  # not a multiple of the chunk size
    a, b = torch.nn.Parameter(torch.randn(n)), None
    b = torch.nn.Parameter(a.detach().clone())
    ours = CPUAdam([a], lr=1e-2, weight_decay=0.1, adamw_mode=adamw, amsgrad=amsgrad, chunk_numel=1 << 15, threads=2)
    cls = torch.optim.AdamW if adamw else torch.optim.Adam
    theirs = cls([b], lr=1e-2, weight_decay=0.1, amsgrad=amsgrad, fused=True)
    copy = torch.empty(n, dtype=torch.bfloat16)
    ours.copy_out[a] = copy
    for _ in range(3):
        g = torch.randn(n)
        a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        theirs.step()
    assert torch.equal(a, b)
    assert torch.equal(copy, a.detach().bfloat16())  # the fused copy-out is the updated weight


def test_cpu_adam_refuses_what_it_cannot_update():
    p = torch.nn.Parameter(torch.randn(4, dtype=torch.bfloat16))
    p.grad = torch.zeros_like(p)
    with pytest.raises(ValueError, match="fp32 tensors on the CPU"):
        CPUAdam([p]).step()
    with pytest.raises(ValueError, match="bias_correction=False"):
        DeepSpeedCPUAdam([torch.nn.Parameter(torch.randn(2))], bias_correction=False)


# ---- the fused host step: CPU Adam reads the gradients where they arrived -----------------------------
def _old_path_grads(g16, inv, coef):
    """What the separate passes make of a bf16 gradient: fp32 copy, unscale (with the NaN/Inf
    check), clip."""
    g = g16.float()
    torch._amp_foreach_non_finite_check_and_unscale_([g], torch.zeros(1), inv.reshape(1))
    torch._foreach_mul_([g], coef)
    return g


@pytest.mark.parametrize("same_buffer", [False, True])
def test_cpu_adam_reads_bf16_gradients_and_applies_multipliers_bit_for_bit(same_buffer):
    """grad_in + grad_multipliers + copy_out equal the separate passes and torch's fused AdamW,
    also when the updated weights are written over the gradients they came from (offload's
    staging buffer); chunks of several threads, a size that is not a multiple of the chunk."""
    torch.manual_seed(0)
    n = 300_007
    a = torch.nn.Parameter(torch.randn(n))
    b = torch.nn.Parameter(a.detach().clone())
    ours = CPUAdam([a], lr=1e-2, weight_decay=0.1, chunk_numel=1 << 15, threads=2)
    theirs = torch.optim.AdamW([b], lr=1e-2, weight_decay=0.1, fused=True)
    g16 = torch.empty(n, dtype=torch.bfloat16)
    out = g16 if same_buffer else torch.empty(n, dtype=torch.bfloat16)
    ours.grad_in[a], ours.copy_out[a] = g16, out
    inv, coef = torch.tensor(2.0**-10), torch.tensor(0.37)
    for _ in range(3):
        g16.copy_(torch.randn(n) * 1024)
        b.grad = _old_path_grads(g16, inv, coef)
        ours.grad_multipliers = (inv, coef)
        ours.step()
        theirs.step()
        assert torch.equal(a, b)
        assert torch.equal(out, a.detach().bfloat16())
    assert a.grad is None  # the gradient was read from grad_in, never made whole in fp32


def test_fused_host_step_measures_shards_as_they_leave_and_flags_only_nan_inf():
    """Each master run's norm is taken from the device shard as it leaves for the host (those of
    an fp32 copy, unscaled, bit for bit); the flag is set by a NaN or an Inf anywhere, not by
    finite values whose squares overflow."""
    from types import SimpleNamespace

    from zerotron.zero.offload import FusedHostStep, HostBuffers

    n = 1000
    host = HostBuffers(2 * n, torch.bfloat16, pin_memory=False)
    masters = [torch.nn.Parameter(host.masters[i * n : (i + 1) * n]) for i in range(2)]
    buckets = [SimpleNamespace(index=i, offset=i * n, shard_numel=n) for i in range(2)]
    step = FusedHostStep(
        host, CPUAdam(masters, threads=1), masters, [(0, n), (n, 2 * n)], [(buckets[0], 0, n), (buckets[1], 0, n)]
    )
    torch.manual_seed(0)
    shards = [torch.randn(n).bfloat16() for _ in range(2)]

    def flag(inv=1.0):
        for b, shard in zip(buckets, shards):
            host.gradient_out(b, shard)
        return step.inspect(inv).item()

    assert flag(2.0**-3) == 0
    for norm, shard in zip(step.norms, shards):
        assert torch.equal(norm, torch._foreach_norm([shard.float() * 2.0**-3])[0])
    assert torch.equal(host.staging, torch.cat(shards))  # the gradients arrived where the weights leave from
    for value in (float("nan"), float("inf"), float("-inf")):
        shards[1][-3] = value
        assert flag() == 1, value
    shards[1][-3] = 0.0
    shards[0][:4] = 3e38  # finite in bf16; the squares overflow fp32
    assert flag() == 0 and not torch.isfinite(step.norms[0])
