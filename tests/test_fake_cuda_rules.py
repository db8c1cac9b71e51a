"""The fake-CUDA mechanism itself (tools/fake_cuda): what it refuses as CUDA refuses it, what it counts as a
host sync, the CUDA kernels' contracts it applies on the host; and the GPU-only defects it found, each caught
on a fake GPU (and failing here before its fix)."""

import pytest
import torch
from distributed import run_ranks

from tools.fake_cuda import FakeCuda, FakeCudaError


# ---- CUDA's rules --------------------------------------------------------------------------------------
def test_a_host_tensor_meeting_a_device_tensor_is_refused_with_the_operands_named():
    with FakeCuda():
        weight = torch.ones(4, 4, device="cuda")
        with pytest.raises(FakeCudaError, match=r"addmm.*same device.*float32\[2, 4\] on cpu"):
            torch.nn.functional.linear(torch.ones(2, 4), weight, torch.zeros(4, device="cuda"))
        assert (weight * torch.tensor(2.0)).device.type == "cuda"  # (a host scalar is allowed, as on CUDA)


def test_a_device_tensor_sees_a_gpu_and_reads_back_as_on_one():
    with FakeCuda(device_count=2, index=1) as gpu:
        x = torch.arange(6.0).cuda()
        assert torch.cuda.is_available() and x.device == torch.device("cuda", 1) and x.is_cuda
        assert x.view(2, 3).t().device == x.device and x.cpu().device.type == "cpu"
        with pytest.raises(TypeError, match="can't convert cuda:1 device type tensor to numpy"):
            x.numpy()
        assert x.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
        p = torch.nn.Parameter(torch.zeros(6))
        p.data = x  # (the device belongs to the storage, as on a GPU)
        assert p.is_cuda
        assert torch.cuda.memory_allocated() >= 24
    assert [s.what.split(" of ")[0] for s in gpu.syncs][-2:] == ["copy", "tolist"]  # (.cpu(), .tolist())


def test_what_makes_the_host_wait_is_counted_and_what_does_not_is_not():
    with FakeCuda() as gpu:
        x = torch.arange(8, device="cuda")
        gpu.take_syncs()
        pinned = torch.zeros(8, dtype=torch.int64, pin_memory=True)
        x.sum().item()  # a device value read
        x[x > 3]  # a boolean mask: the output's size is on the device
        torch.tensor([1, 2], device="cuda")  # a blocking copy from pageable memory
        pinned.copy_(x, non_blocking=True)  # into pinned memory, asynchronously: no wait
        x.to("cpu", non_blocking=True)  # torch pins a non-blocking download's output: no wait
        torch.ones(8).to("cuda", non_blocking=True)  # staged by the driver: listed apart
        staged = list(gpu.staged)
        syncs = [s.what for s in gpu.take_syncs()]
    assert len(syncs) == 3 and "local_scalar_dense" in syncs[0] and "index" in syncs[1], syncs
    assert syncs[2].startswith("copy of int64[2] to the device") and len(staged) == 1


def test_cudas_kernels_shapes_and_layouts():
    """The memory-efficient attention's log-sum-exp comes padded to 32 rows (NaN in the padding) and its output
    in BMHK memory, as CUDA's kernel returns them; the flash kernel refuses fp32."""
    aten = torch.ops.aten
    with FakeCuda():
        q = torch.randn(1, 2, 24, 16, device="cuda")
        out, lse, *_ = aten._scaled_dot_product_efficient_attention(q, q, q, None, True, 0.0, True)
        assert lse.shape == (1, 2, 32) and torch.isnan(lse[..., 24:]).all() and not torch.isnan(lse[..., :24]).any()
        assert out.stride() == (768, 16, 32, 1)  # [b, m, h, d] in memory
        with pytest.raises(FakeCudaError, match="FlashAttention only supports fp16 and bf16"):
            aten._scaled_dot_product_flash_attention(q, q, q)


def test_the_grouped_matrix_multiply_wants_16_byte_aligned_operands():
    with FakeCuda():
        flat = torch.zeros(3 + 2 * 8 * 8, dtype=torch.bfloat16, device="cuda")
        weight = flat[3:].view(2, 8, 8)  # 6 bytes past a 16-byte boundary
        rows, offsets = torch.ones(4, 8, dtype=torch.bfloat16, device="cuda"), torch.tensor([2, 4], device="cuda")
        with pytest.raises(FakeCudaError, match="aligned to 16 bytes"):
            torch._grouped_mm(rows, weight.transpose(-2, -1), offs=offsets.int())
        assert torch._grouped_mm(rows, weight.clone().transpose(-2, -1), offs=offsets.int()).shape == (4, 8)


def _collective_on_host():
    import torch.distributed as dist

    dist.all_reduce(torch.ones(2, device="cuda"))
    dist.all_reduce(torch.ones(2))


def test_a_collective_on_a_host_tensor_is_refused_as_nccl_refuses_it():
    with pytest.raises(Exception, match="allreduce_ of a float32\\[2\\] tensor in host memory"):
        run_ranks(_collective_on_host, 2, fake_cuda=True, timeout=60)


# ---- what it found -------------------------------------------------------------------------------------
def test_stacked_experts_index_their_rows_on_the_device():
    """Expert parallelism on stacked experts (Transformers' families) built the route index from host counts
    with `torch.repeat_interleave(arange_on_device, torch.tensor(counts))`: an index_select with a host index."""
    from zerotron.moe.grouped import Groups
    from zerotron.moe.stacked_experts import _local_experts

    class FamilyExperts(torch.nn.Module):  # Transformers' interface: rows, their expert, their weight
        def forward(self, rows, index, weights):
            return rows * (index + 1) * weights

    with FakeCuda():
        rows = torch.ones(5, 2, device="cuda")
        out = _local_experts(FamilyExperts(), rows, Groups([2, 0, 3], None))
        assert out[:, 0].tolist() == [1.0, 1.0, 3.0, 3.0, 3.0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ring_attention_blocks_merge_at_a_chunk_that_is_not_a_multiple_of_32(dtype):
    """Ring attention took the memory-efficient kernel's log-sum-exp as [b, h, m]: CUDA pads it to 32 rows, and
    merging two blocks of 24 queries broadcast 32 against 24. Now fp32 cuts it to the queries (and pads it back
    for the backward), bf16 takes the flash kernel, whose log-sum-exp is not padded; both equal SDPA."""
    from zerotron.long_context import ring

    g = torch.Generator().manual_seed(0)
    with FakeCuda():
        q, k, v, go = (torch.randn(1, 2, 48, 16, generator=g).to("cuda", dtype) for _ in range(4))
        scale, (q1, q2), (k1, k2), (v1, v2) = 16**-0.5, q.chunk(2, 2), k.chunk(2, 2), v.chunk(2, 2)
        out1, lse1, rng = ring._block_forward(q1, k1, v1, True, scale)
        pieces = [ring._block_forward(q2, k1, v1, False, scale)[:2], ring._block_forward(q2, k2, v2, True, scale)[:2]]
        out2, lse2 = ring._merge(*ring._merge(None, None, *pieces[0]), *pieces[1])
        want = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
        got = torch.cat([out1.float(), out2], dim=2)
        assert lse2.shape == (1, 2, 24) and (got - want).abs().max().item() < (1e-5 if dtype == torch.float32 else 2e-2)
        dq, dk, dv = ring._block_backward(go[:, :, 24:], q2, k2, v2, out2.to(dtype), lse2, True, scale, rng)
        assert dq.shape == q2.shape and not torch.isnan(dq).any()


def test_a_page_lock_the_host_refuses_leaves_no_cuda_error_behind():
    """A refused cudaHostRegister (page-locked memory at the host's limit) leaves CUDA's last error set; the
    next kernel launch's check used to report it as its own failure. The offload buffer falls back to torch's
    pinned allocator and the error is taken."""
    from zerotron.zero.offload import host_empty

    with FakeCuda() as gpu:
        gpu.runtime.cudart.fail_host_register = True
        buffer = host_empty(1024, torch.float32, pin=True)
        assert (torch.ones(4, device="cuda") + 1).sum().item() == 8  # (before the fix: "CUDA error: out of memory")
        assert buffer.is_pinned()


def _pipeline_with_the_comms_logger():
    from parity import ds_config, global_batches, make_model, micro_batches

    import zerotron
    from tools.fake_cuda import FakeCuda
    from zerotron.comm import log
    from zerotron.parallelize import to_pipeline

    FakeCuda.current().sync_wait_s = 5.0
    module = to_pipeline(make_model(n_layer=4, n_kv_head=4), 4, partition_method="type:_PipeBlock")
    config = ds_config(1, 8, pipeline={"schedule": "1f1b"}, comms_logger={"enabled": True})
    engine, *_ = zerotron.initialize(model=module, config=config)
    for b in global_batches(2, 8):
        engine.train_batch(iter(micro_batches(b, 0, 1, 8)))
    summary = log.LOG.summary()
    return sorted(summary), summary["p2p"]


def test_the_comms_logger_times_a_four_stage_pipeline_without_waiting_on_its_posted_receives():
    """The comms log timed each operation with torch.cuda.synchronize(), which also waits for the receives 1F1B
    posts ahead: at 4 stages every stage waited on another (a deadlock, found on a fake GPU). CUDA events now,
    read when the log is summarized."""
    for names, p2p in run_ranks(_pipeline_with_the_comms_logger, 4, fake_cuda=True, timeout=120):
        assert "p2p" in names and all(row["count"] > 0 and row["total_latency_ms"] >= 0 for row in p2p.values())


def _stalled_collective_on_nccl():
    """A collective that returns at once and never completes, as NCCL's does when a peer never arrives."""
    import torch.distributed as dist

    from zerotron import watchdog
    from zerotron.comm import Comm

    class Enqueued:  # NCCL: neither the call nor wait() blocks the host
        def wait(self, *args):
            return True

        def is_completed(self):
            return False

    comm, messages = Comm(None, "dp"), []
    comm.blocking_wait = False  # (NCCL's)
    watch = watchdog.get()
    watch.timeout_s, watch.poll_s, watch._exit = 1.0, 0.2, messages.append
    if dist.get_rank() == 0:
        real, dist.all_reduce = dist.all_reduce, lambda *a, **k: Enqueued()
        try:
            comm.all_reduce(torch.ones(2))  # blocking on gloo; on NCCL it returns and the device waits
        finally:
            dist.all_reduce = real
    import time

    deadline = time.monotonic() + 10
    while not messages and time.monotonic() < deadline and dist.get_rank() == 0:
        time.sleep(0.1)
    watch.stop()
    return messages


def test_a_stalled_collective_is_named_on_nccl_where_wait_does_not_block():
    """The watchdog's records ended when the call or its wait() returned: on NCCL both return before the
    device is done, so a stalled collective stayed silent until NCCL's own timeout. They end on completion."""
    messages = run_ranks(_stalled_collective_on_nccl, 2, timeout=60)[0]
    assert messages and "collective timeout" in messages[0] and "all_reduce(SUM) #" in messages[0], messages
