"""Run a function on N gloo ranks in fresh processes; a hang fails in seconds, errors name the rank.

Processes come from a fork server that has already imported torch and zerotron, so starting
ranks costs milliseconds instead of a full interpreter start per rank.
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import socket
import time
import traceback

_ctx = mp.get_context("forkserver")
# torch._dynamo is imported by the first torch optimizer (seconds); pay that once, here.
# Imported once in the fork server, not in every rank (Transformers' model modules take seconds).
_ctx.set_forkserver_preload(
    [
        "torch",
        "torch.distributed",
        "torch._dynamo",
        "zerotron",
        "transformers",
        "transformers.models.llama.modeling_llama",
        "transformers.models.gpt2.modeling_gpt2",
        "transformers.models.mistral.modeling_mistral",
        "transformers.models.qwen2.modeling_qwen2",
    ]
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(fn, rank, world_size, port, args, results, timeout_s, fake_cuda=False):
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        OMP_NUM_THREADS="1",
    )
    import faulthandler

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    # A hung rank prints where it is stuck shortly before the parent gives up on it.
    faulthandler.dump_traceback_later(max(1.0, timeout_s - 2), exit=False)
    backend = "gloo"
    if fake_cuda:  # this rank sees GPU number `rank` under CUDA's rules (tools/fake_cuda), NCCL's group on gloo
        from tools.fake_cuda import BACKEND, FakeCuda

        FakeCuda(device_count=world_size, index=rank).__enter__()  # (the process ends with the test)
        backend = BACKEND
    try:
        timeout = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout)
        # Plain pickle copies tensor data into the message; the queue's own pickler would share
        # storage through file descriptors that die with this process.
        value = pickle.dumps(fn(*args))
        if dist.is_initialized():  # rank 0 hosts the store: no rank leaves while another still uses it
            dist.barrier()  # (under load a finished rank 0 could reset a slower rank's group set-up)
        results.put((rank, "ok", value))
    except BaseException as e:  # report everything, including SystemExit from argparse
        results.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class RankError(RuntimeError):
    pass


# gloo's TCP mesh setup can fail on a machine saturated by other jobs; that is the transport, not
# the code under test, so such a run is retried once with a fresh port.
_TRANSPORT_FLAKE = "connectFullMesh failed"


def run_ranks(fn, world_size: int, *args, timeout: float = 60.0, fake_cuda: bool = False) -> list:
    """Run `fn(*args)` on ranks 0..world_size-1; return their results in rank order. With `fake_cuda`,
    each rank runs on a fake GPU of its own under CUDA's rules (tools/fake_cuda: `FakeCuda.current()`).

    Raises RankError naming the failing rank(s) and their tracebacks, or naming the ranks that had
    not finished when `timeout` seconds passed (they are killed; nothing is left hanging).
    """
    try:
        return _run_ranks_once(fn, world_size, args, timeout, fake_cuda)
    except RankError as e:
        if _TRANSPORT_FLAKE not in str(e):
            raise
        return _run_ranks_once(fn, world_size, args, timeout, fake_cuda)


def _run_ranks_once(fn, world_size: int, args, timeout: float, fake_cuda: bool) -> list:
    port = free_port()
    results = _ctx.Queue()
    procs = [
        _ctx.Process(target=_rank_main, args=(fn, r, world_size, port, args, results, timeout, fake_cuda), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    outputs, errors = {}, {}
    deadline = time.monotonic() + timeout
    try:
        while len(outputs) + len(errors) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0 and errors:
                break
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(outputs) - set(errors))
                raise RankError(f"ranks {missing} did not finish within {timeout:.0f}s (hang?)" + _format(errors))
            try:
                rank, status, value = results.get(timeout=min(remaining, 1.0))
            except Exception:
                dead = [
                    r
                    for r, p in enumerate(procs)
                    if p.exitcode not in (None, 0) and r not in outputs and r not in errors
                ]
                for r in dead:
                    errors[r] = f"process exited with code {procs[r].exitcode} without reporting"
                continue
            if status == "ok":
                outputs[rank] = pickle.loads(value)
            else:
                errors[rank] = value
            if errors:  # one failed rank leaves the others waiting: collect theirs briefly, then stop
                deadline = min(deadline, time.monotonic() + 2.0)
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.5)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise RankError(_format(errors))
    return [outputs[r] for r in range(world_size)]


def _format(errors: dict) -> str:
    return "".join(f"\n--- rank {r} ---\n{msg}" for r, msg in sorted(errors.items()))
