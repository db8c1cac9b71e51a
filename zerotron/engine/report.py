"""What the engine says after a step: the planner's memory prediction beside what the rank holds
(once, after the first step, when optimizer states exist), every `steps_per_print` steps the
loss, learning rate and throughput (to the log and the configured monitors), and the flops profile of
the config's `flops_profiler.profile_step` (zerotron/profiling)."""

from __future__ import annotations

import time

import torch

from ..log import logger
from ..profiling import engine_hook as profiling

MIB = 2**20


class StepReport:
    def __init__(self, engine):
        self.steps_per_print, self.monitor = engine.config.steps_per_print, engine.monitor
        self.window_start = time.perf_counter()  # of the steps the next printed throughput covers
        self.flops_profile = profiling.attach(engine)  # None unless enabled (and on global rank 0)

    def after_step(self, engine, losses: list[torch.Tensor]):
        if self.flops_profile is not None:
            self.flops_profile.after_step()
        if engine.global_steps == 1:
            self._memory(engine)
        print_now = engine.global_steps % self.steps_per_print == 0
        if not (print_now or self.monitor.enabled) or not losses:
            return
        loss = torch.stack(losses).float().mean().item()
        if self.monitor.enabled:
            samples = engine.global_samples
            events = [("Train/Samples/train_loss", loss, samples), ("Train/Samples/lr", engine.get_lr()[0], samples)]
            if engine.loss_scaler.enabled:
                events.append(("Train/Samples/loss_scale", engine.loss_scaler.scale, samples))
            self.monitor.write(events)
        if print_now:
            elapsed = time.perf_counter() - self.window_start
            self.window_start = time.perf_counter()
            logger.info(
                f"step={engine.global_steps} loss={loss:.4f} lr={engine.get_lr()} "
                f"skipped={engine.skipped_steps} "
                f"samples/s={self.steps_per_print * engine.train_batch_size() / elapsed:.1f}"
            )

    @staticmethod
    def _memory(engine):
        """Gradients are held from backward to the step and freed by it, so theirs is the
        predicted peak alone."""
        predicted, measured = engine.predicted_memory(), engine.memory_report()
        kept = ("params", "master_weights", "optimizer")
        logger.info(
            f"rank {engine.global_rank} model states: predicted {sum(predicted[k] for k in kept) / MIB:.1f} "
            f"MiB, measured {sum(measured.get(k, 0) for k in kept) / MIB:.1f} MiB ("
            + ", ".join(f"{k} {predicted[k] / MIB:.1f}/{measured.get(k, 0) / MIB:.1f}" for k in kept)
            + f"); gradients from backward to the step: predicted {predicted['grads'] / MIB:.1f} MiB"
        )
