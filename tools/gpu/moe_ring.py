"""The GPU runbook's checks of the paths mixture of experts and long context take on a GPU (part `correct`,
one GPU, a world of one):

- ring attention's autograd function in bf16 with grouped key/value heads (8 query heads, 2 key/value) over a
  ring of 2, each rank's queries two chunks of 24 (not a multiple of 32: the memory-efficient kernel pads its
  log-sum-exp there): the output and the q, k, v gradients against SDPA over the whole sequence. One GPU holds
  both ring ranks: two threads, their blocks passed through a mailbox instead of NCCL (`_Loopback`);
- the reference MoE GPT (moe-tiny) in bf16 through torch's grouped matrix multiply against a loop over its
  experts: each step's loss;
- the host syncs of one moe-tiny step: the agreement, one host read of the routes' counts per MoE layer and
  micro-batch, and the loss read.

The same code runs on the CPU (the smoke run) and, in tests/test_gpu_runbook_smoke.py, on a fake GPU."""

from __future__ import annotations

import queue
import threading

SEQ, KV_HEADS, HEADS, HEAD_DIM = 96, 2, 8, 64  # 2 x cp chunks of 24 queries each


class _Loopback:
    """What ring attention uses of a Comm (rank, size, group, batch_p2p), for `size` threads of one process.
    As on NCCL, a pair's messages match its receives in the order both were posted, whatever order the
    receives are waited in."""

    def __init__(self, mailboxes, rank: int, size: int):
        self.mailboxes, self.rank, self.size, self.group = mailboxes, rank, size, None
        self.posted, self.arrived = {}, {}  # per source: receives posted; messages taken off the mailbox

    def batch_p2p(self, ops, header: int = 0):
        import torch.distributed as dist

        for op in ops:
            if op.op is dist.isend:
                self.mailboxes[(self.rank, op.peer)].put(op.tensor.clone())
        receives = []
        for op in ops:
            if op.op is dist.irecv:
                receives.append((op, self.posted.get(op.peer, 0)))
                self.posted[op.peer] = receives[-1][1] + 1
        comm = self

        class Work:
            def wait(self):
                for op, number in receives:
                    arrived = comm.arrived.setdefault(op.peer, [])
                    while len(arrived) <= number:
                        arrived.append(comm.mailboxes[(op.peer, comm.rank)].get(timeout=60))
                    op.tensor.copy_(arrived[number])
                    arrived[number] = None
                receives.clear()

        return Work()


def ring_autograd(device, dtype_name: str = "bf16") -> dict:
    """Ring attention over 2 threads (load-balanced halves) against SDPA: output and gradients."""
    import torch
    import torch.nn.functional as F

    import zerotron
    from zerotron.long_context import ring

    zerotron.init_distributed()  # (a world of one: torch's point-to-point descriptions want a group)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    g = torch.Generator().manual_seed(0)
    q, go = (torch.randn(1, HEADS, SEQ, HEAD_DIM, generator=g).to(device, dtype) for _ in range(2))
    k, v = (torch.randn(1, KV_HEADS, SEQ, HEAD_DIM, generator=g).to(device, dtype) for _ in range(2))
    whole = [t.clone().requires_grad_() for t in (q, k, v)]
    groups = HEADS // KV_HEADS
    want = F.scaled_dot_product_attention(
        whole[0], whole[1].repeat_interleave(groups, 1), whole[2].repeat_interleave(groups, 1), is_causal=True
    )
    want.backward(go)
    cp = 2
    mailboxes = {(a, b): queue.Queue() for a in range(cp) for b in range(cp)}
    results, errors = [None] * cp, []

    def rank_main(rank):
        try:
            mine = [ring.ring_shard(t, 2, rank, cp).clone().requires_grad_() for t in (q, k, v)]
            out = ring._RingAttention.apply(*mine, _Loopback(mailboxes, rank, cp), True, HEAD_DIM**-0.5)
            out.backward(ring.ring_shard(go, 2, rank, cp))
            results[rank] = (out.detach(), *(t.grad for t in mine))
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(f"rank {rank}: {type(e).__name__}: {str(e)[:300]}")

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(cp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    if errors or any(r is None for r in results):
        return {"ok": False, "error": "; ".join(errors) or "a ring rank did not finish"}
    got = [ring.ring_unshard([r[i] for r in results], 2) for i in range(4)]
    wanted = [want] + [t.grad for t in whole]
    errs = [((a.float() - b.float()).abs().max() / b.float().abs().max()).item() for a, b in zip(got, wanted)]
    tolerance = 2e-2 if dtype == torch.bfloat16 else 1e-5  # (of the largest element: out, dq, dk, dv)
    return {
        "dtype": dtype_name,
        "queries_per_block": SEQ // (2 * cp),
        "max_rel_errors": errs,
        "ok": max(errs) < tolerance,
    }


def _moe_engine(device):
    import torch

    import zerotron
    from tools import training
    from zerotron.models.gpt import GPT, config_for

    torch.manual_seed(0)
    model = GPT(config_for("moe-tiny", max_seq_len=64)).to(device)
    adamw = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0}
    config = training.zerotron_config(2, 1.0, adamw=adamw, gas=2, zero_optimization={"stage": 1})
    config["bf16"] = {"enabled": True}
    return zerotron.initialize(model=model, config=config)[0]


def _moe_batches(device, n=3):
    from tools import training

    return [(x.to(device), y.to(device)) for x, y in training.make_batches(n, 4, 64, 256, seed=2)]


def _train(engine, batches):
    gas = engine.gradient_accumulation_steps()
    return [engine.train_batch(iter(list(zip(x.chunk(gas), y.chunk(gas))))).item() for x, y in batches]


def moe_grouped(device) -> dict:
    """moe-tiny in bf16: the grouped matrix multiply against a loop over the experts, step by step."""
    from zerotron.moe import grouped as grouped_module

    grouped = _train(_moe_engine(device), _moe_batches(device))
    fits, grouped_module._grouped_mm_fits = grouped_module._grouped_mm_fits, lambda rows, weight: False
    try:
        looped = _train(_moe_engine(device), _moe_batches(device))
    finally:
        grouped_module._grouped_mm_fits = fits
    worst = max(abs(a - b) / abs(b) for a, b in zip(grouped, looped))
    return {"grouped": grouped, "loop": looped, "max_loss_rel": worst, "ok": worst < 1e-2}


def moe_host_syncs(device) -> dict:
    """The host syncs of one moe-tiny step after warm-up: the agreement, 2 layers x 2 micro-batches of route
    counts, the loss read."""
    from tools.gpu.device import host_syncs

    batches = _moe_batches(device, 2)
    return host_syncs(_moe_engine(device), _train, batches[:1], batches[1:], budget=1 + 2 * 2 + 1)
