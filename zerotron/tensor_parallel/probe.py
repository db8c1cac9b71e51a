"""A plan is checked on the model before training: a wrong plan is refused, never trained silently.

Every rank holds the whole model before the split. The probe runs a few tokens through it and
records each module's output; after the split it runs the same tokens through the parallel model
and compares, module by module in execution order, the outputs that are whole on every rank (the
split ones are checked through the modules that read them). Then it runs backward: a replicated
parameter must receive the same gradient on every tensor-parallel rank, else it saw only this
rank's part of the data and the plan is missing a style for it. The first difference is a
ConfigError naming the module or parameter. The cost is one forward of the whole model and one
forward and backward of the parallel model on `tokens` tokens, at start-up.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from ..comm import Comm
from ..errors import ConfigError


def tolerance(dtype: torch.dtype) -> float:
    """Relative to an output's magnitude: far above the rounding of another summation order (a few
    ulps of the model's dtype, accumulated over layers), far below what a wrong split gives (O(1))."""
    return max(1e-4, 8 * torch.finfo(dtype).eps)


class PlanProbe:
    """`with PlanProbe(model, call, comm): apply the plan` refuses a plan that changes the model.
    `call(model, ids)` runs the model on token ids and returns a scalar loss."""

    def __init__(self, model: nn.Module, call, comm: Comm, vocab_size: int, tokens: int = 8):
        self.model, self.call, self.comm = model, call, comm
        g = torch.Generator().manual_seed(1234)  # the same probe on every rank
        first = next(model.parameters())
        self.ids = torch.randint(0, vocab_size, (1, tokens), generator=g).to(first.device)
        self.tol = tolerance(first.dtype if first.is_floating_point() else torch.float32)

    def __enter__(self):
        with self._quiet(), torch.no_grad():
            self.whole, _ = self._run(grad=False)
        return self

    def __exit__(self, kind, value, tb):
        if kind is None:
            self._check()
        return False

    @contextlib.contextmanager
    def _quiet(self):
        """No lasting trace: RNG, train/eval mode and gradients as they were."""
        rng, training = torch.get_rng_state(), self.model.training
        self.model.eval()  # no dropout: both runs see the same function
        try:
            yield
        finally:
            torch.set_rng_state(rng)
            self.model.train(training)
            for p in self.model.parameters():
                p.grad = None

    def _run(self, grad: bool):
        outputs, handles = {}, []
        ids = self.ids.to(next(self.model.parameters()).device)  # (the split model may have moved)

        def record(name):
            def hook(module, args, out):
                if name not in outputs:  # a module called twice: its first call
                    outputs[name] = _first_tensor(out)

            return hook

        for name, module in self.model.named_modules():
            handles.append(module.register_forward_hook(record(name)))
        try:
            with torch.enable_grad() if grad else contextlib.nullcontext():
                loss = self.call(self.model, ids)
        finally:
            for h in handles:
                h.remove()
        return outputs, loss

    def _check(self):
        with self._quiet():
            try:
                split, loss = self._run(grad=True)
            except Exception as e:  # noqa: BLE001 - the split model cannot run: name where
                raise ConfigError(
                    "tensor_parallel.autotp_size",
                    self.comm.size,
                    f"the model fails to run split by its tensor-parallel plan ({type(e).__name__}: "
                    f"{e}); use autotp_size 1 for this model",
                ) from e
            names = list(self.whole)
            partial = {n for n, m in self.model.named_modules() if getattr(m, "tp_partial_output", False)}
            differs = [
                i
                for i, name in enumerate(names)
                if name not in partial and _differs(split.get(name), self.whole[name], self.tol)
            ]
            # Every rank names the same module (the first any rank saw differ), so all of them stop.
            device = next(self.model.parameters()).device
            mine = torch.tensor([differs[0] if differs else len(names)], device=device)
            first = min(int(t.item()) for t in self.comm.all_gather_list(mine))
            if first < len(names):
                name = names[first]
                raise ConfigError(
                    "tensor_parallel.autotp_size",
                    self.comm.size,
                    f"split by its tensor-parallel plan the model computes something else: the output "
                    f"of {name or 'the model'} ({type(self.model.get_submodule(name)).__name__}) differs "
                    "from the unsplit model's. The plan does not fit this module; use autotp_size 1 "
                    "for this model",
                )
            loss.backward()
            self._check_replicated_gradients()

    def _check_replicated_gradients(self):
        named = [(n, p) for n, p in self.model.named_parameters() if not hasattr(p, "tp_split_dim") and p.requires_grad]
        if not named:
            return
        sums = torch.stack(
            [
                torch.stack([p.grad.float().sum(), p.grad.float().square().sum()])
                if p.grad is not None
                else torch.zeros(2, device=p.device)
                for _, p in named
            ]
        )
        every = self.comm.all_gather_list(sums)
        for i, (name, _) in enumerate(named):
            values = torch.stack([e[i] for e in every])
            spread = (values - values[0]).abs().max().item()
            if spread > self.tol * (values[0].abs().max().item() + 1e-12):
                raise ConfigError(
                    "tensor_parallel.autotp_size",
                    self.comm.size,
                    f"parameter {name} is kept whole but gets a different gradient on each tensor-"
                    "parallel rank: it sees only this rank's part of the data, and the plan has no "
                    "style that sums its gradient; use autotp_size 1 for this model",
                )


def _differs(got, want, tol: float) -> bool:
    """Outputs whole on this rank that disagree (split outputs have other shapes: not compared)."""
    if want is None or got is None or got.shape != want.shape or want.numel() == 0:
        return False
    return (got.float().to(want.device) - want.float()).abs().max().item() > tol * (
        want.float().abs().max().item() + 1e-6
    )


def _first_tensor(out):
    from ..nested import tensors_in

    return next((t.detach().clone() for t in tensors_in(out) if t.is_floating_point()), None)
