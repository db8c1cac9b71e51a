"""Which optimizers may run on ZeRO's flat shards: an update that is elementwise gives the same result
on any cut of a tensor; one that reads whole tensors (LAMB's trust ratio, Adafactor's factored
moments) does not. zerotron's and torch's own optimizers are trusted; any other is probed."""

from __future__ import annotations

import copy

import torch

from ..log import warn


def _trusted() -> set[type]:
    """Classes whose update is elementwise by construction (torch's and zerotron's own): not probed.
    Exact classes only: a subclass may override step() with anything, so it is probed."""
    from ..ops.adagrad import DeepSpeedCPUAdagrad
    from ..ops.adam import CPUAdam, FusedAdam
    from ..ops.lion import DeepSpeedCPULion, FusedLion

    o = torch.optim
    return {
        o.SGD,
        o.Adam,
        o.AdamW,
        o.Adagrad,
        o.Adamax,
        o.NAdam,
        o.RAdam,
        o.RMSprop,
        o.ASGD,
        o.Rprop,
        o.Adadelta,
        CPUAdam,
        FusedAdam,
        FusedLion,
        DeepSpeedCPULion,
        DeepSpeedCPUAdagrad,
    }


def _known_not_elementwise(optimizer) -> str | None:
    """Why this optimizer (or a subclass of one) is known not to be elementwise, or None."""
    if getattr(optimizer, "elementwise", None) is False:
        return getattr(optimizer, "not_elementwise_because", "it says so (elementwise = False)")
    known = {
        "LBFGS": "it searches along directions built from dot products over all parameters at once",
        "Adafactor": "it factors each matrix's second moment into row and column statistics",
        "Muon": "it orthogonalizes each whole matrix (Newton-Schulz iterations on its 2-D shape)",
        "SparseAdam": "it takes only sparse gradients of whole tensors",
    }
    for name, why in known.items():
        cls = getattr(torch.optim, name, None)
        if cls is not None and isinstance(optimizer, cls):
            return why
    return None


def _rebuild(optimizer, groups):
    """A fresh instance of the optimizer's class over `groups` (each carrying a group's settings),
    with the instance's plain settings (e.g. an adam_w_mode attribute) copied over."""
    cls = type(optimizer)
    try:
        fresh = cls(groups, **optimizer.defaults)
    except TypeError:
        fresh = cls(groups)
    for key, value in vars(optimizer).items():
        if key.startswith("_") or key in ("defaults", "state", "param_groups"):
            continue
        if value is None or isinstance(value, (bool, int, float, str)):
            setattr(fresh, key, value)
    return fresh


def probe_elementwise(optimizer: torch.optim.Optimizer, device=None, steps: int = 3):
    """Does this optimizer's update treat every element on its own? Fresh instances with each
    param group's settings train two parameters (a matrix and a vector) whole, and the same numbers
    flattened and cut in two at an odd place, as two ranks' shards would hold them (one instance per
    piece: a shard's optimizer sees nothing of the other pieces), for `steps` steps with the same
    gradients. Returns ("elementwise", None), ("differs", detail) or ("untested", detail). The
    global RNG state is left as it was."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    shapes, cut = [(5, 6), (7,)], 13
    gen = torch.Generator().manual_seed(20240607)
    numel = sum(torch.Size(s).numel() for s in shapes)
    # Magnitudes that grow along the flat order: each piece's norms differ from the whole tensor's.
    scale = torch.linspace(0.2, 3.0, numel)
    flat0 = torch.randn(numel, generator=gen) * scale
    grads = [torch.randn(numel, generator=gen) * scale.flip(0) for _ in range(steps)]
    seen = set()
    for group in optimizer.param_groups:
        hyper = {k: v for k, v in group.items() if k != "params"}
        key = repr(sorted(hyper.items(), key=lambda kv: kv[0]))
        if key in seen:
            continue
        seen.add(key)
        lr = hyper.get("lr")
        if isinstance(lr, (int, float)) and lr == 0:  # a warm-up schedule may start at 0: nothing to compare
            hyper["lr"] = 1e-2
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            try:
                whole = [
                    torch.nn.Parameter(t.clone().reshape(s).to(device))
                    for t, s in zip(flat0.split([torch.Size(s).numel() for s in shapes]), shapes)
                ]
                pieces = [
                    torch.nn.Parameter(flat0[:cut].clone().to(device)),
                    torch.nn.Parameter(flat0[cut:].clone().to(device)),
                ]
                optimizers = [_rebuild(optimizer, [{"params": whole, **copy.deepcopy(hyper)}])] + [
                    _rebuild(optimizer, [{"params": [p], **copy.deepcopy(hyper)}]) for p in pieces
                ]
                for g in grads:
                    g = g.to(device)
                    for p, gp in zip(whole, g.split([p.numel() for p in whole])):
                        p.grad = gp.reshape(p.shape).clone()
                    pieces[0].grad, pieces[1].grad = g[:cut].clone(), g[cut:].clone()
                    for o in optimizers:
                        o.step()
            except Exception as e:  # noqa: BLE001 - any failure means: could not test
                return "untested", f"rebuilding it on a probe parameter and stepping failed: {type(e).__name__}: {e}"
        with torch.no_grad():
            a = torch.cat([p.detach().reshape(-1) for p in whole]).float().cpu()
            b = torch.cat([p.detach().reshape(-1) for p in pieces]).float().cpu()
        moved = (a - flat0).abs().max().item()
        if not torch.isfinite(a).all() or not torch.isfinite(b).all():
            return "untested", "the probe's updates were not finite"
        if moved == 0:
            return "untested", "the probe's steps did not change the parameters"
        diff = (a - b).abs().max().item()
        if diff > 1e-4 * moved:
            return "differs", (
                f"after {steps} steps the parameters trained whole and in two pieces differ by "
                f"{diff:.2g} (the updates are ~{moved:.2g})"
            )
    return "elementwise", None


def check_shardable(optimizer: torch.optim.Optimizer, *, stage: int, device=None, allow_untested: bool = False) -> None:
    """Raise ValueError unless `optimizer` may run on ZeRO's flat shards (each rank updates a 1-D
    slice of the flattened parameters that can start and end inside a tensor), which is exact only
    when its update is elementwise. Torch's and zerotron's elementwise classes are trusted; classes
    known not to be elementwise are refused; any other is probed (`probe_elementwise`).
    `allow_untested` (DeepSpeed's "zero_allow_untested_optimizer": true) lets one that could not be
    tested, or that the probe found to differ, run anyway, with a warning."""
    cls = type(optimizer)
    if cls in _trusted():
        return
    name = cls.__name__
    head = (
        f"ZeRO stage {stage} runs the optimizer on flat shards of the parameters (each rank updates a 1-D slice "
        "that can cut through a tensor), which is exact only for elementwise optimizers. "
    )
    fix = (
        "Use zero_optimization.stage 0 (every rank updates whole tensors), or an elementwise optimizer (AdamW, "
        "Adam, SGD, Lion, Adagrad, ...)"
    )
    why = _known_not_elementwise(optimizer)
    if why is not None:
        raise ValueError(f"{head}{name} is not elementwise: {why}, which a flat shard does not have. {fix}.")
    verdict, detail = probe_elementwise(optimizer, device)
    if verdict == "elementwise":
        return
    if verdict == "differs":
        problem = (
            f"{name} is not elementwise: {detail}, so its update depends on whole-tensor norms or shapes, "
            "which a flat shard does not have."
        )
        if allow_untested:
            warn(
                f"{head}{problem} zero_allow_untested_optimizer is set, so it runs anyway: training will "
                "differ from one process"
            )
            return
        raise ValueError(f"{head}{problem} {fix}.")
    problem = f"{name} is not one zerotron knows to be elementwise, and it could not be tested ({detail})."
    if allow_untested:
        warn(
            f"{head}{problem} zero_allow_untested_optimizer is set, so it runs anyway: this is exact only "
            "if its update treats every element on its own"
        )
        return
    raise ValueError(
        f'{head}{problem} If its update is elementwise, set "zero_allow_untested_optimizer": true in '
        f"the config to use it anyway; otherwise: {fix}."
    )
