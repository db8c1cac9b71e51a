"""The flops profile as text: DeepSpeed's number formats (its public `*_to_string` helpers) and the
printed profile (totals, top modules per depth, the model tree with each module's numbers)."""

from __future__ import annotations

import contextlib
import os

import torch.nn as nn

PRECISION = 2
_PREFIXES = ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K"), (1, ""), (1e-3, "m"), (1e-6, "u"))


def number_to_string(num, units=None, precision=PRECISION) -> str:
    """`num` with an SI prefix: 1.5e9 -> "1.5 G" (`units` forces one: "T", "G", "M", "K", "m", "u")."""
    if units is None:
        scale, units = next(((s, u) for s, u in _PREFIXES if num >= s or (u == "" and num == 0)), _PREFIXES[-1])
    else:
        scale = dict((u, s) for s, u in _PREFIXES).get(units, 1)
    return f"{round(num / scale, precision):g} {units}"


def flops_to_string(flops, units=None, precision=PRECISION) -> str:
    return number_to_string(flops, units, precision) + "FLOPS"


def macs_to_string(macs, units=None, precision=PRECISION) -> str:
    return number_to_string(macs, units, precision) + "MACs"


def bytes_to_string(b, units=None, precision=PRECISION) -> str:
    return number_to_string(b, units, precision) + "B"


def params_to_string(params, units=None, precision=PRECISION) -> str:
    """Parameter counts say B (billions) where the other numbers say G."""
    units = units.replace("B", "G") if units else units
    return number_to_string(params, units, precision).replace("G", "B").strip()


def duration_to_string(seconds, units=None, precision=PRECISION) -> str:
    return number_to_string(seconds, units, precision) + "s"


def _share(part, whole) -> str:
    return f"{round(100 * part / whole, PRECISION) if whole else 0:g}%"


def _line(label: str, value) -> None:
    print(f"{label:<70}  {value}")


@contextlib.contextmanager
def _destination(output_file):
    """stdout, or `output_file` (its directory made) for the duration."""
    if not output_file:
        yield
        return
    os.makedirs(os.path.dirname(os.path.abspath(output_file)), exist_ok=True)
    with open(output_file, "w") as f, contextlib.redirect_stdout(f):
        yield


def print_profile(prof, profile_step, module_depth, top_modules, detailed, output_file):
    flops, macs, params, latency = (
        prof.get_total_flops(),
        prof.get_total_macs(),
        prof.get_total_params(),
        prof.get_total_duration(),
    )
    engine = prof.ds_engine
    mp = engine.mp_world_size if engine is not None else 1
    with _destination(output_file):
        print("\n-------------------------- Flops Profiler (zerotron) --------------------------")
        print(f"Profile at step {profile_step}, per rank (GPU). FLOPs: torch.utils.flop_counter's count of the")
        print("forward's matrix products, convolutions and attention; MACs = FLOPs / 2; latency: forward only\n")
        if engine is not None:
            _line("world size:", engine.world_size)
            _line("data parallel size:", engine.dp_world_size)
            _line("model parallel size:", mp)
            _line("batch size per GPU:", engine.train_micro_batch_size_per_gpu())
        _line("params per GPU:", params_to_string(params))
        _line("params of model = params per GPU * mp_size:", params_to_string(params * mp))
        _line("fwd MACs per GPU:", macs_to_string(macs))
        _line("fwd flops per GPU:", number_to_string(flops))
        _line("fwd flops of model = fwd flops per GPU * mp_size:", number_to_string(flops * mp))
        _line("fwd latency:", duration_to_string(latency))
        _line(
            "fwd FLOPS per GPU = fwd flops per GPU / fwd latency:", flops_to_string(flops / latency if latency else 0)
        )
        rest = getattr(prof, "after_forward_latency", None)  # the engine's: backward and step of the profiled step
        if rest:
            factor = 3 + prof.recompute_fwd_factor
            _line("bwd + step latency:", duration_to_string(rest))
            _line("iter latency:", duration_to_string(latency + rest))
            _line(
                f"FLOPS per GPU = {factor:g} * fwd flops per GPU / iter latency:",
                flops_to_string(factor * flops / (latency + rest)),
            )
        print("\n----------------------------- Aggregated Profile per GPU -----------------------------")
        print_aggregated(prof, module_depth, top_modules)
        if detailed:
            print("\n------------------------------ Detailed Profile per GPU ------------------------------")
            print("Each module: params, % of params, MACs, % of MACs, fwd latency, % of latency, fwd FLOPS.")
            print("A parent's numbers include its children's and what it computes itself (e.g. a functional loss).\n")
            _print_tree(prof, prof.model, type(prof.model).__name__, 0, (params, macs, latency))
        print("------------------------------------------------------------------------------")


def _numbers(prof, module: nn.Module, totals) -> str:
    params, flops, seconds = prof.module_params(module), prof.module_flops(module), prof.module_duration(module)
    return ", ".join(
        [
            f"{params_to_string(params)} = {_share(params, totals[0])} Params",
            f"{macs_to_string(flops // 2)} = {_share(flops // 2, totals[1])} MACs",
            f"{duration_to_string(seconds)} = {_share(seconds, totals[2])} latency",
            flops_to_string(round(flops / seconds, PRECISION) if seconds else 0),
        ]
    )


def _print_tree(prof, module: nn.Module, name: str, depth: int, totals) -> None:
    print(f"{'  ' * depth}{name}: {type(module).__name__}({_numbers(prof, module, totals)})")
    for child_name, child in module.named_children():
        _print_tree(prof, child, f"({child_name})", depth + 1, totals)


def print_aggregated(prof, module_depth=-1, top_modules=1) -> None:
    """Per depth of the module tree, the `top_modules` module classes with the most parameters, MACs
    and forward latency (summed over the modules of a class at that depth)."""
    by_depth: list[dict[str, list]] = []

    def walk(module: nn.Module, depth: int):
        if depth == len(by_depth):
            by_depth.append({})
        row = by_depth[depth].setdefault(type(module).__name__, [0, 0, 0.0])
        row[0] += prof.module_params(module)
        row[1] += prof.module_flops(module) // 2
        row[2] += prof.module_duration(module)
        for child in module.children():
            walk(child, depth + 1)

    walk(prof.model, 0)
    depth = len(by_depth) - 1 if module_depth == -1 else min(module_depth, len(by_depth))
    print(f"Top {top_modules} modules in terms of params, MACs or fwd latency at different model depths:")
    for d in range(depth):
        rows = by_depth[d]

        def top(i, fmt):
            best = sorted(rows.items(), key=lambda kv: kv[1][i], reverse=True)[:top_modules]
            return {name: fmt(v[i]) for name, v in best}

        print(f"depth {d}:")
        print(f"    params      - {top(0, params_to_string)}")
        print(f"    MACs        - {top(1, macs_to_string)}")
        print(f"    fwd latency - {top(2, duration_to_string)}")


__all__ = [
    "number_to_string",
    "flops_to_string",
    "macs_to_string",
    "bytes_to_string",
    "params_to_string",
    "duration_to_string",
    "print_profile",
    "print_aggregated",
]
