"""The comms log (DeepSpeed's `comms_logger` section and `deepspeed.comm.log_summary()`): each
collective's name, bytes and time, kept per message size while the log is enabled.

Two kinds of operations are logged: the engine's own (zerotron's `Comm`, under the kind names and
bytes `engine.comm_stats()` counts: all_reduce, reduce_scatter, all_gather, broadcast, all_to_all,
p2p, so the log's bytes per name add up to comm_stats()), and the `deepspeed.comm` functions a script
calls (under their `log_name`, with the bytes of the tensor they are given, as DeepSpeed logs them).
A blocking operation is timed to its return; an asynchronous one of the engine's, from its launch to
the end of its wait() (so time overlapped with computation counts). On a GPU the times are the device's:
CUDA events on the current stream, read when the log is summarized (reading them as they happen would
make the host wait for everything queued on the device, the receives a pipeline posts ahead included,
which deadlocks 1F1B from four stages on). Disabled, the log costs one attribute test per operation.

Bandwidths follow nccl-tests: algbw = bytes / time, busbw = algbw x 2(n-1)/n for all-reduce and
x (n-1)/n for all-gather, reduce-scatter and all-to-all (n: the group's size; the gathered or
scattered bytes are the whole tensor's), in Gbit/s.
"""

from __future__ import annotations

import datetime
import functools
import inspect
import sys
import time

import torch
import torch.distributed as dist

from ..log import logger

_BUS_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
}


def _bus_factor(op: str, n: int) -> float:
    family = "all_reduce" if op == "inference_all_reduce" else next((f for f in _BUS_FACTOR if op.startswith(f)), None)
    return _BUS_FACTOR[family](n) if family and n > 1 else 1.0


def size_string(nbytes: int) -> str:
    """1536 -> "1.5 KB" (powers of 1024, as DeepSpeed prints message sizes)."""
    units, size = ("B", "KB", "MB", "GB", "TB", "PB"), float(nbytes)
    i = 0
    while size >= 1024 and i < len(units) - 1:
        size, i = size / 1024, i + 1
    return f"{round(size, 2):g} {units[i]}"


def _trimmed_mean(values: list[float], cut: float = 0.1) -> float:
    """The mean without the `cut` fraction of smallest and of largest values (DeepSpeed's outlier rule)."""
    ordered = sorted(values)
    k = int(len(ordered) * cut)
    kept = ordered[k : len(ordered) - k] or ordered
    return sum(kept) / len(kept)


class CommsLog:
    def __init__(self):
        self.enabled, self.verbose, self.prof_all, self.prof_ops, self.debug = False, False, True, [], False
        self.records: dict[str, dict[int, list]] = {}  # name -> bytes -> [count, [ms], [algbw], [busbw]]
        self.unread: list = []  # operations timed by CUDA events not read yet (see record)

    def configure(self, section=None, **settings):
        """From the config's comms_logger section and/or DeepSpeed's keyword settings (None: unchanged)."""
        if section is not None:
            for key in ("enabled", "verbose", "prof_all", "prof_ops", "debug"):
                setattr(self, key, getattr(section, key))
        for key, value in settings.items():
            if value is not None:
                setattr(self, key, list(value) if key == "prof_ops" else value)

    def wants(self, name: str, prof: bool = False) -> bool:
        return self.enabled and (prof or self.prof_all or name in self.prof_ops)

    def named(self, name: str) -> str:
        """A record's name: with `debug`, the calling function's added (call it where the operation starts)."""
        return f"{name} | [Caller Func: {_caller()}]" if self.debug else name

    def record(self, name: str, nbytes: int, took, group_size: int, op: str | None = None):
        """`took`: seconds, or a (start, end) pair of CUDA events, read when the log is next summarized."""
        if isinstance(took, tuple):
            self.unread.append((name, nbytes, took, group_size, op))
            return
        ms = took * 1e3
        algbw = nbytes * 8 / took / 1e9 if took > 0 else 0.0
        busbw = algbw * _bus_factor(op or name, group_size)
        row = self.records.setdefault(name, {}).setdefault(nbytes, [0, [], [], []])
        row[0] += 1
        for values, v in zip(row[1:], (ms, algbw, busbw)):
            values.append(v)
        if self.verbose:
            logger.info(
                f"comm op: {name} | time (ms): {ms:.2f} | msg size: {size_string(nbytes)} | "
                f"algbw (Gbps): {algbw:.2f} | busbw (Gbps): {busbw:.2f}"
            )

    def reset(self):
        self.records.clear()
        self.unread.clear()

    def _read(self) -> None:
        """The device times of the operations timed by CUDA events (each end event waited for alone)."""
        unread, self.unread = self.unread, []
        for name, nbytes, (start, end), group_size, op in unread:
            end.synchronize()
            self.record(name, nbytes, start.elapsed_time(end) / 1e3, group_size, op)

    def summary(self) -> dict:
        """{name: {bytes: {count, total_latency_ms, avg_latency_ms, tput_avg_gbps, busbw_avg_gbps,
        msg_size_bytes, msg_size_str}}} (DeepSpeed's layout; averages without outliers)."""
        self._read()
        return {
            name: {
                nbytes: {
                    "count": count,
                    "total_latency_ms": sum(ms),
                    "avg_latency_ms": _trimmed_mean(ms),
                    "tput_avg_gbps": _trimmed_mean(alg),
                    "busbw_avg_gbps": _trimmed_mean(bus),
                    "msg_size_bytes": nbytes,
                    "msg_size_str": size_string(nbytes),
                }
                for nbytes, (count, ms, alg, bus) in sorted(sizes.items())
            }
            for name, sizes in self.records.items()
        }

    def print_summary(self, summary: dict) -> None:
        columns = ("Comm. Op", "Message Size", "Count", "Total Latency(ms)", "Avg Latency(ms)")
        print("".join(f"{c:<20}" for c in columns + ("tput_avg (Gbps)", "busbw_avg (Gbps)")))
        for name, sizes in summary.items():
            print(name)
            for s in sizes.values():
                print(
                    f"{'':<20}{s['msg_size_str']:<20}{s['count']:<20}{s['total_latency_ms']:<20.2f}"
                    f"{s['avg_latency_ms']:<20.2f}{s['tput_avg_gbps']:<20.2f}{s['busbw_avg_gbps']:<20.2f}"
                )


LOG = CommsLog()


def _caller() -> str:
    """The first function outside zerotron.comm on the stack (what `debug` adds to a record's name)."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__", "").startswith(__package__):
        frame = frame.f_back
    return frame.f_code.co_name if frame is not None else "?"


class _Clock:
    """How long an operation takes: on a GPU, CUDA events on the current stream (the time of the operation,
    not of its launch; read later, see the module's docstring); elsewhere the host's clock."""

    def __init__(self, tensor):
        self.cuda = isinstance(tensor, torch.Tensor) and tensor.is_cuda
        if self.cuda:
            self.start = torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.start = time.perf_counter()

    def took(self):
        """Seconds, or the (start, end) events to read them from."""
        if not self.cuda:
            return time.perf_counter() - self.start
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        return self.start, end


class Timing:
    """One logged operation of the engine's Comm, from launch to done() (called once)."""

    def __init__(self, name: str, nbytes: int, group_size: int, tensor):
        self.name, self.nbytes, self.group_size = LOG.named(name), nbytes, group_size
        self.op = name
        self.clock = _Clock(tensor)

    def done(self):
        if self.clock is None:
            return
        LOG.record(self.name, self.nbytes, self.clock.took(), self.group_size, self.op)
        self.clock = None


def _nbytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(getattr(v, "tensor", v)) for v in value)  # (P2POp wraps its tensor)
    return 0


def logged(fn):
    """A deepspeed.comm function, logged (under its log_name, with its input's bytes) when the log wants it."""
    signature = inspect.signature(fn)
    names = list(signature.parameters)
    default_name = signature.parameters["log_name"].default if "log_name" in names else fn.__name__
    tensor_param = next((p for p in ("tensor", "tensors", "input_tensor_list", "tensor_list") if p in names), None)

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if not LOG.enabled:
            return fn(*args, **kwargs)
        name = kwargs.get("log_name", default_name)
        if not LOG.wants(name, kwargs.get("prof", False)):
            return fn(*args, **kwargs)
        bound = signature.bind_partial(*args, **kwargs).arguments
        tensor = bound.get(tensor_param)
        size = dist.get_world_size(bound.get("group")) if dist.is_initialized() else 1
        name, clock = LOG.named(name), _Clock(tensor)
        try:
            return fn(*args, **kwargs)
        finally:
            LOG.record(name, _nbytes(tensor), clock.took(), size, op=fn.__name__)

    return call


def configure(deepspeed_config=None, enabled=None, prof_all=None, prof_ops=None, verbose=None, debug=None):
    """The comms log's settings: from a config's comms_logger section (a zerotron Config, or DeepSpeed's
    config object), then the keywords given."""
    comms = getattr(deepspeed_config, "comms_config", deepspeed_config)  # DeepSpeed's config keeps it there
    section = getattr(comms, "comms_logger", None)
    if section is not None and not isinstance(section, bool):
        LOG.configure(section)
    LOG.configure(enabled=enabled, prof_all=prof_all, prof_ops=prof_ops, verbose=verbose, debug=debug)


def log_summary(show_straggler=False, return_dict=False):
    """This rank's comms log, printed by rank 0 as DeepSpeed does (op, message size, count, total
    and average latency, bandwidths); with return_dict, DeepSpeed's dict. A collective call: every rank calls
    it. show_straggler adds each record's straggler time (its latency above the fastest rank's)."""
    initialized = dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if initialized else (0, 1)
    if initialized:
        dist.barrier()
    summary = LOG.summary()
    stragglers = _stragglers(summary) if show_straggler else None
    if rank == 0:
        LOG.print_summary(summary)
        if stragglers:
            print(f"{'Comm. Op':<20}{'Message Size':<20}{'Count':<20}{'Total Straggler(ms)':<20}")
            for name, sizes in stragglers.items():
                for s in sizes.values():
                    print(f"{name:<20}{s['msg_size_str']:<20}{s['count']:<20}{s['total_straggler_ms']:<20.2f}")
    if initialized:
        dist.barrier()
    if return_dict:
        when = datetime.datetime.now().isoformat()
        return {
            "summary": summary,
            "straggler_analysis": stragglers,
            "metadata": {"world_size": world, "rank": rank, "timestamp": when},
        }
    return None


def _stragglers(summary: dict) -> dict:
    """Per record, its total latency minus the fastest rank's (every rank's totals gathered as one object, so
    the host's numbers never need a device tensor): every rank must hold the same records, as every rank runs
    the same collectives."""
    keys = [(name, nbytes) for name, sizes in summary.items() for nbytes in sizes]
    totals = [summary[n][b]["total_latency_ms"] for n, b in keys]
    everyone = [(keys, totals)]
    if dist.is_initialized() and dist.get_world_size() > 1:
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (keys, totals))
        if any(theirs != keys for theirs, _ in everyone):
            raise RuntimeError(
                "log_summary(show_straggler=True): the ranks logged different operations, so their "
                "latencies cannot be compared; enable the comms logger on every rank with the same prof_ops"
            )
    fastest = [min(column) for column in zip(*(t for _, t in everyone))]
    out: dict = {}
    for (name, nbytes), total, low in zip(keys, totals, fastest):
        row = summary[name][nbytes]
        out.setdefault(name, {})[nbytes] = {
            "count": row["count"],
            "total_comm_lat_ms": low,
            "total_straggler_ms": total - low,
            "avg_comm_lat_ms": low / row["count"],
            "avg_straggler_ms": (total - low) / row["count"],
            "msg_size_bytes": nbytes,
            "msg_size_str": row["msg_size_str"],
        }
    return out


def reset_log():
    """Forget what the comms log holds (per-epoch summaries)."""
    LOG.reset()
