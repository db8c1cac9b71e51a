"""DeepSpeed's `safe_get_full_*` / `safe_set_full_*` (and `_local_`) functions: a parameter's fp32
master value, gradient and optimizer states as if nothing were partitioned, under ZeRO 0-3.

Each rank holds pieces of each parameter: the whole of it under ZeRO 0, a flat range of it (the
part in this rank's shard of the parameter's bucket, possibly empty) under ZeRO 1-3. A full
value is assembled by each rank writing its pieces into a zero buffer and summing the buffers
over the data-parallel group, so under ZeRO 1-3 these are collectives: every data-parallel rank
must call them for the same parameters in the same order. Tensor parallelism is left as it is:
a tensor-parallel parameter's "full" value is this rank's tensor-parallel part, as in DeepSpeed.

Differences from DeepSpeed, on purpose:
- gradients are returned in fp32 and divided by the fp16 loss scale (what the optimizer will
  see), and a set gradient is taken in those terms too;
- setting a parameter's value writes the fp32 master *and* the model's weights (every data-parallel
  rank gets them), so the next forward computes with it, not only the step after;
- ZeRO stage 0 answers too (DeepSpeed returns None there unless bf16 is on), and the `_local_`
  variants work under every stage (this rank's piece, flat; the whole parameter under stage 0).
Parameters no engine trains give None, as in DeepSpeed; frozen parameters give their value for
the fp32 parameter and None for gradients and optimizer states.
"""

from __future__ import annotations

import weakref

import torch

from .engines import engine_of_param

_layouts: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class _Layout:
    """Where one engine keeps each parameter's pieces on this rank (asked of its ModelStates)."""

    def __init__(self, engine):
        from ...comm import Comm

        states = engine.states
        self.engine, self.states = engine, states
        self.masters: dict[int, list] = {}  # id(p) -> [(start in param, length, optimizer's master, offset)]
        for p, start, length, master, offset in states.pieces():
            self.masters.setdefault(id(p), []).append((start, length, master, offset))
        # Sharded states: a Comm of its own (these collectives are not training traffic: engine.comm_stats())
        self.comm = None if states.replicated else Comm(engine.topology.group("dp"), "dp")

    # ---- assembling --------------------------------------------------------------------------
    def empty(self, param) -> torch.Tensor:
        return torch.zeros(self.states.param_shape(param).numel(), dtype=torch.float32, device=self.engine.device)

    def full(self, param, pieces) -> torch.Tensor:
        """Every rank's `pieces` [(start, length, source tensor, offset in it)] summed into one tensor."""
        buffer = self.empty(param)
        for start, length, source, offset in pieces:
            buffer[start : start + length].copy_(source.reshape(-1)[offset : offset + length])
        if self.comm is not None and self.comm.size > 1:
            self.comm.all_reduce(buffer)
        return buffer.view(self.states.param_shape(param))

    def local(self, param, pieces) -> torch.Tensor:
        parts = [source.reshape(-1)[offset : offset + length].float() for _, length, source, offset in pieces]
        if not parts:
            return torch.zeros(0, dtype=torch.float32, device=self.engine.device)
        return torch.cat(parts) if len(parts) > 1 else parts[0].clone()

    @staticmethod
    def write(pieces, value: torch.Tensor, local: bool = False):
        """Copy `value` (the whole parameter, or with `local` this rank's pieces end to end) into pieces."""
        flat = value.detach().reshape(-1)
        at = 0
        with torch.no_grad():
            for start, length, target, offset in pieces:
                src = flat[at : at + length] if local else flat[start : start + length]
                target.reshape(-1)[offset : offset + length].copy_(src.to(target.device, target.dtype))
                at += length

    # ---- what is stored where -------------------------------------------------------------------
    def state_pieces(self, param, key):
        """The pieces of optimizer state `key`: [(start, length, state tensor, offset)]; None when
        the optimizer keeps no such state (yet: before the first step); the value itself when it
        is a per-tensor scalar (Adam's step), which is not partitioned. The branch taken depends
        only on the optimizer's states, so every rank takes the same one."""
        state = self.engine.optimizer.state
        sample = next((s[key] for s in state.values() if key in s), None)
        if sample is None:
            return None
        mine = [
            (start, length, master, offset)
            for start, length, master, offset in self.masters.get(id(param), [])
            if key in state.get(master, {})
        ]
        if not torch.is_tensor(sample) or sample.dim() == 0:
            value = state[mine[0][2]][key] if mine else sample
            return value.clone() if torch.is_tensor(value) else value
        return [(start, length, state[master][key], offset) for start, length, master, offset in mine]

    def grad_pieces(self, param):
        return self.states.grad_pieces(param)

    def loss_scale(self) -> float:
        scaler = self.engine.loss_scaler
        return scaler.scale if scaler.enabled else 1.0

    def trains(self, param) -> bool:
        return self.states.param_shape(param) is not None

    def publish(self, param):
        """Bring the model's weights in line with `param`'s (changed) masters, on every rank."""
        self.states.republish([param], comm=self.comm)

    def grads_changed(self, param):
        """A gradient written after backward: with offload, send it to the host again at the step."""
        self.states.grads_changed([param])


def _layout(param) -> _Layout | None:
    engine = engine_of_param(param)
    if engine is None:
        return None
    layout = _layouts.get(engine.states)
    if layout is None:
        layout = _layouts[engine.states] = _Layout(engine)
    return layout


# ---- full values (collective under ZeRO 1-3) -------------------------------------------------------
def safe_get_full_fp32_param(param):
    """The whole fp32 master value of `param` (a collective over the data-parallel group under ZeRO 1-3)."""
    lay = _layout(param)
    if lay is None:
        return None
    if not lay.trains(param):  # frozen: whole on every rank
        return param.detach().float().clone()
    return lay.full(param, lay.masters.get(id(param), []))


def safe_set_full_fp32_param(param, value):
    """Set `param`'s fp32 master to `value` (its full shape) and the model's weights with it; every
    data-parallel rank must call it, with the same value."""
    lay = _layout(param)
    if lay is None:
        return
    if not lay.trains(param):
        with torch.no_grad():
            param.copy_(value)
        return
    lay.write(lay.masters.get(id(param), []), value)
    lay.publish(param)


def safe_get_full_optimizer_state(param, optim_state_key):
    """The whole fp32 optimizer state `optim_state_key` (e.g. "exp_avg") of `param`; None if the
    optimizer keeps no such state yet."""
    lay = _layout(param)
    if lay is None or not lay.trains(param):
        return None
    pieces = lay.state_pieces(param, optim_state_key)
    return lay.full(param, pieces) if isinstance(pieces, list) else pieces


def safe_set_full_optimizer_state(param, value, optim_state_key):
    lay = _layout(param)
    if lay is None or not lay.trains(param):
        return
    pieces = _existing_state(lay, param, optim_state_key)
    lay.write(pieces, value)


def safe_get_full_grad(param):
    """The whole gradient of `param` after backward and before the step, in fp32 and unscaled (a
    collective under ZeRO 1-3). Under ZeRO 0 and 1 it is the reduced gradient once the boundary
    backward of an accumulation has run."""
    return _get_grad(param, local=False)


def safe_set_full_grad(param, value):
    """Replace `param`'s gradient (full shape, unscaled terms) before the step."""
    _set_grad(param, value, local=False)


def _get_grad(param, local: bool):
    lay = _layout(param)
    if lay is None or not lay.trains(param):
        return None
    pieces = lay.grad_pieces(param)
    if pieces is None:
        return None
    grad = lay.local(param, pieces) if local else lay.full(param, pieces)
    scale = lay.loss_scale()
    return grad / scale if scale != 1.0 else grad


def _set_grad(param, value, local: bool):
    lay = _layout(param)
    if lay is None or not lay.trains(param):
        return
    pieces = lay.grad_pieces(param)
    if pieces is None:
        raise RuntimeError("this parameter has no gradient yet: call it after backward")
    lay.write(pieces, value.detach().float() * lay.loss_scale(), local=local)
    lay.grads_changed(param)


def safe_update_full_grad_vectorized(param_list, update_func):
    """For each parameter, set its gradient to update_func(current full gradient, parameter)."""
    for p in param_list:
        grad = safe_get_full_grad(p)
        if grad is not None:
            safe_set_full_grad(p, update_func(grad, p))


# ---- this rank's pieces (no communication, except setting a parameter) ------------------------------
def safe_get_local_fp32_param(param):
    """This rank's piece of `param`'s fp32 master, flat (possibly empty)."""
    lay = _layout(param)
    if lay is None:
        return None
    if not lay.trains(param):
        return param.detach().float().reshape(-1).clone()
    return lay.local(param, lay.masters.get(id(param), []))


def safe_set_local_fp32_param(param, value):
    """Set this rank's piece (flat, as safe_get_local_fp32_param gives it); the model's weights
    follow, so every data-parallel rank must call it."""
    lay = _layout(param)
    if lay is None or not lay.trains(param):
        return
    lay.write(lay.masters.get(id(param), []), value, local=True)
    lay.publish(param)


def safe_get_local_optimizer_state(param, optim_state_key):
    lay = _layout(param)
    if lay is None or not lay.trains(param):
        return None
    pieces = lay.state_pieces(param, optim_state_key)
    return lay.local(param, pieces) if isinstance(pieces, list) else pieces


def safe_set_local_optimizer_state(param, value, optim_state_key):
    lay = _layout(param)
    if lay is None or not lay.trains(param):
        return
    lay.write(_existing_state(lay, param, optim_state_key), value, local=True)


def safe_get_local_grad(param):
    """This rank's piece of `param`'s reduced gradient, flat, fp32, unscaled."""
    return _get_grad(param, local=True)


def safe_set_local_grad(param, value):
    _set_grad(param, value, local=True)


def _existing_state(lay, param, key):
    pieces = lay.state_pieces(param, key)
    if pieces is None:
        raise KeyError(f"the optimizer has no state {key!r} (yet): optimizer states exist after the first step")
    if not isinstance(pieces, list):
        raise TypeError(f"optimizer state {key!r} is a per-tensor scalar, not a tensor shaped like the parameter")
    return pieces
