"""bench/zero.py's memory measure: every tensor reachable from a system's objects (reachable_tensors), this
rank's model-state bytes by kind (state_breakdown), and MemoryProbe, which samples them at hooks during one step."""

from __future__ import annotations

import collections
import functools
import types

import torch

from bench import common

# ---- memory: tensor bytes reachable from a system's objects ---------------------------------------
_LEAVES = (
    str,
    bytes,
    int,
    float,
    complex,
    bool,
    type(None),
    type,
    types.ModuleType,
    types.BuiltinFunctionType,
    torch.device,
    torch.dtype,
    torch.Size,
)


def reachable_tensors(roots, limit: int = 2_000_000):
    """Every tensor reachable from `roots` through attributes, slots, containers, bound methods,
    partials and closures (hooks), and through tensors' .grad and attributes (DeepSpeed's ds_tensor)."""
    seen, stack, found = set(), list(roots), []
    while stack and len(seen) < limit:
        o = stack.pop()
        if id(o) in seen or isinstance(o, _LEAVES):
            continue
        seen.add(id(o))
        if torch.is_tensor(o):
            found.append(common.local_tensor(o))
            if o.is_leaf and o.grad is not None:
                stack.append(o.grad)
            stack.extend(getattr(o, "__dict__", {}).values())
            continue
        if isinstance(o, dict):
            stack.extend(o.keys())
            stack.extend(o.values())
        elif isinstance(o, (list, tuple, set, frozenset, collections.deque)):
            stack.extend(o)
        elif isinstance(o, types.MethodType):
            stack.append(o.__self__)
        elif isinstance(o, functools.partial):
            stack.extend((o.func, o.args, o.keywords))
        elif isinstance(o, types.FunctionType):
            stack.extend(c.cell_contents for c in (o.__closure__ or ()) if _cell_full(c))
        else:
            stack.extend(getattr(o, "__dict__", {}).values())
            for cls in type(o).__mro__:
                for s in getattr(cls, "__slots__", ()):
                    if isinstance(s, str) and s not in ("__dict__", "__weakref__"):
                        try:
                            stack.append(getattr(o, s))
                        except AttributeError:
                            pass
    return found


def _cell_full(cell) -> bool:
    try:
        cell.cell_contents
        return True
    except ValueError:
        return False


def state_breakdown(params, optimizers, roots, hints=None) -> dict[str, int]:
    """This rank's model-state bytes by kind; each storage counts once, in the first kind it shows up:
    params (the module's parameters as they are now: full, shards or empty), grads (of those and of the
    optimizer's tensors), optimizer (its state), masters (the optimizer's tensors when they are not the
    parameters: fp32 master shards), other (anything else the system holds: flat gradient buckets,
    gathered parameters, communication buffers). `hints` {kind: tensors} names a system's own
    buffers (zerotron's flat gradient and master buffers) so that they land in their kind, not in other."""
    seen: set[int] = set()

    def count(tensors) -> int:
        return common.tensor_bytes(tensors, seen)

    params, hints = list(params), hints or {}
    opt_params = [p for o in optimizers for g in o.param_groups for p in g["params"]]
    out = {
        "params": count(
            [p for p in params] + [getattr(p, "ds_tensor", None) for p in params] + hints.get("params", [])
        ),
        "grads": count([p.grad for p in params + opt_params if p.grad is not None] + hints.get("grads", [])),
        "optimizer": count(v for o in optimizers for s in o.state.values() for v in s.values()),
        "masters": count(opt_params + hints.get("masters", [])),
    }
    out["other"] = count(reachable_tensors(roots))
    out["total"] = sum(out.values())
    return out


class MemoryProbe:
    """Samples state_breakdown at hooks during one armed step; `peak` is the largest sample."""

    def __init__(self, blocks, params, optimizers, roots, hints=lambda: None):
        self.params, self.optimizers, self.roots, self.hints = params, optimizers, roots, hints
        self.armed, self.samples = False, []
        for i, block in enumerate(blocks):
            block.register_forward_pre_hook(lambda m, a, i=i: self.sample(f"forward block {i}"))
            block.register_forward_hook(lambda m, a, out, i=i: self._on_output(out, i))
        for opt in optimizers[:1]:
            opt.register_step_pre_hook(lambda *a: self.sample("before optimizer step"))
            opt.register_step_post_hook(lambda *a: self.sample("after optimizer step"))

    def _on_output(self, out, i):
        t = out[0] if isinstance(out, (tuple, list)) else out
        if self.armed and torch.is_tensor(t) and t.requires_grad:
            t.register_hook(lambda g: self.sample(f"backward block {i}"))

    def sample(self, where):
        if self.armed:
            breakdown = state_breakdown(self.params(), self.optimizers, self.roots(), self.hints())
            self.samples.append({"at": where, **breakdown})

    def wrap(self, step, armed_step: int = 2):
        """`step`, with the probe armed during its `armed_step`-th call (an untimed warm-up step)."""
        calls = [0]

        def wrapped(tokens, targets):
            calls[0] += 1
            self.armed = calls[0] == armed_step
            try:
                return step(tokens, targets)
            finally:
                if self.armed:
                    self.sample("after step")
                self.armed = False

        return wrapped

    @property
    def peak(self) -> dict:
        return max(self.samples, key=lambda s: s["total"]) if self.samples else {}
