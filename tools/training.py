"""What a measured run trains with: the DeepSpeed config and one-step functions of zerotron and plain
torch, seeded batches of random bytes, and the planner's FLOPs.

Shared by the benchmarks (bench/) and the GPU runbook (tools/gpu/). Systems: ADAMW, zerotron_config,
zerotron_step, engine_step, torch_step (each step function is `step(tokens, targets) -> float loss`, keeping
its own state). Data: make_batches. FLOPs: gpt_shape, flops_per_token (the planner's 6N + 12·L·d·s),
peak_flops (the planner's hardware table).
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch

ADAMW = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}  # every system, every benchmark


def zerotron_config(
    per_rank: int, clip: float = 0.0, stage: int = 0, adamw: dict | None = ADAMW, gas: int = 1, **sections
) -> dict:
    """A DeepSpeed config: `per_rank` sequences per micro-step, `gas` micro-steps, ZeRO `stage`, gradient
    clipping `clip` (set explicitly: DeepSpeed's default is 1.0), AdamW `adamw` (None: a client optimizer);
    `sections` add or replace top-level sections."""
    config = {
        "train_micro_batch_size_per_gpu": per_rank,
        "gradient_accumulation_steps": gas,
        "steps_per_print": 10**9,
        "zero_optimization": {"stage": stage},
        "gradient_clipping": clip,
    }
    if adamw is not None:
        config["optimizer"] = {"type": "AdamW", "params": {**adamw, "betas": list(adamw["betas"])}}
    return {**config, **sections}


def phase(name: str, on: bool = True):
    """A profiler range around one phase of a step (forward, backward, step), or nothing when not `on`."""
    return torch.profiler.record_function(f"phase:{name}") if on else contextlib.nullcontext()


def engine_step(engine, phases: bool = False) -> Callable:
    """The one-step function of a DeepSpeed-style engine (zerotron's or DeepSpeed's)."""

    def step(tokens, targets):
        with phase("forward", phases):
            loss = engine(tokens, targets)
        with phase("backward", phases):
            engine.backward(loss)
        with phase("step", phases):
            engine.step()
        return loss.item()

    return step


def zerotron_step(model, per_rank: int, clip: float, adamw: dict = ADAMW, phases: bool = False, **config):
    """A zerotron engine on `model` (AdamW as every system) and its one-step function; `config` adds or
    overrides sections of the DeepSpeed config (zerotron_config's keywords)."""
    import zerotron

    engine, *_ = zerotron.initialize(model=model, config=zerotron_config(per_rank, clip, adamw=adamw, **config))
    return engine, engine_step(engine, phases)


def torch_step(model, opt, clip: float = 0.0, phases: bool = False, autocast=None, foreach=None) -> Callable:
    """Plain torch: forward (under `autocast()` if given), backward, clip_grad_norm_ to `clip` (0: off),
    opt.step(), opt.zero_grad()."""
    autocast = autocast or contextlib.nullcontext

    def step(tokens, targets):
        with phase("forward", phases), autocast():
            loss = model(tokens, targets)
        with phase("backward", phases):
            loss.backward()
        with phase("step", phases):
            if clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip, foreach=foreach)
            opt.step()
            opt.zero_grad()
        return loss.item()

    return step


def gpt_shape(cfg):
    """The planner's view of a GPT config: its parameter count and FLOPs without building it."""
    from zerotron.planner.model import ModelShape

    return ModelShape.of_gpt(cfg)


def flops_per_token(cfg, seq: int) -> float:
    """6N + 12·L·d·s, N without the embedding (a lookup, not a matmul): the planner's and GPT.flops_per_token."""
    return gpt_shape(cfg).flops_per_token(seq)


def peak_flops(device_name: str) -> float | None:
    """Dense bf16 peak FLOP/s of a GPU, by its name, from the planner's hardware table (None: not in it)."""
    from zerotron.planner.hardware import PRESETS

    name = device_name.lower()
    return next((hw.peak_flops for key, hw in PRESETS.items() if key != "cpu" and key.split("-")[0] in name), None)


def make_batches(
    n: int, batch: int, seq: int, vocab: int, rank: int = 0, world: int = 1, seed: int = 1234, device=None
):
    """`n` steps of (tokens, targets) of random bytes: this rank's contiguous slice of each global batch of
    `batch` sequences (a world of one: all of it), made on `device`."""
    if batch % world:
        raise SystemExit(f"--batch {batch} must be divisible by the {world} ranks")
    g = torch.Generator(device=device or "cpu").manual_seed(seed)
    data = torch.randint(0, vocab, (n, batch, seq + 1), generator=g, device=device)
    per = batch // world
    return [(d[:, :-1].contiguous(), d[:, 1:].contiguous()) for d in data[:, rank * per : (rank + 1) * per]]
