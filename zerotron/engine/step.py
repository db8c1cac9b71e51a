"""The engine's optimizer step and what it agrees on: the `Engine` methods that turn a boundary
backward's gradients into an update (or a skipped step), check the step's inputs and losses, and
report. A mixin of engine.Engine, in a file of its own so the step reads top to bottom."""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from .. import preemption, watchdog
from ..errors import EXIT_PREEMPTED, BadBatchError, ConfigError, NonFiniteError
from ..log import logger
from ..precision import clip_coefficient, global_norm

IGNORE_INDEX = -100  # the label PyTorch's cross_entropy and Transformers' losses skip


@dataclass
class StepVerdict:
    """What every rank agreed on for this step: the ranks whose gradients or loss held NaN/Inf,
    and those asked to stop (SIGTERM/SIGINT)."""
    bad_ranks: list[int]
    bad_loss_ranks: list[int]
    preempting: list[int]
    previous_scale: float = 1.0

    @property
    def overflow(self) -> bool:
        return bool(self.bad_ranks or self.bad_loss_ranks)


class StepStages:
    def optimizer_step(self, lr_kwargs: dict | None = None):
        """Update the weights from the reduced gradients now: what step() does at the accumulation
        boundary, and what the pipeline engine does after its schedule. Read top to bottom: every
        rank agrees on what this step holds; the step is then skipped (NaN/Inf gradients or loss,
        fp16 overflow) or applied (clip, optimizer, publish, scheduler); then the after-step work
        (counters, watchdog, report, preemption)."""
        self._step_applied = False
        self._require_optimizer()
        verdict = self._agree_on_step()
        if verdict.overflow:
            self._skip_step(verdict)
        else:
            self._apply_step(lr_kwargs)
        self._after_step(verdict)

    def _require_optimizer(self):
        if getattr(self.optimizer, "placeholder", False):
            raise ConfigError("optimizer", None, "this engine was built without an optimizer (for inference or "
                              "evaluation), so it cannot step: add an 'optimizer' section to the config or pass "
                              "optimizer= to zerotron.initialize")

    def _agree_on_step(self) -> "StepVerdict":
        """Unscale the gradients, check them, and agree with every other rank (one host sync)."""
        scaled = self.loss_scaler.enabled
        nonfinite = self.states.unscale_and_check(1.0 / self.loss_scaler.scale if scaled else 1.0)
        bad_ranks, bad_loss_ranks, preempting = self._agree(nonfinite)  # every rank skips, or none does
        verdict = StepVerdict(bad_ranks, bad_loss_ranks, preempting, previous_scale=self.loss_scaler.scale)
        self.optimizer.overflow = verdict.overflow  # DeepSpeed's fp16 optimizers expose it; scripts read it
        if scaled:
            self.loss_scaler.update(verdict.overflow)
        return verdict

    def _skip_step(self, verdict: "StepVerdict"):
        self.skipped_steps += 1
        if self.loss_scaler.enabled:  # dynamic loss scaling: overflow is expected now and then
            logger.warning(f"step {self.global_steps}: fp16 gradients overflowed, step skipped; "
                           f"loss scale {verdict.previous_scale:g} -> {self.loss_scaler.scale:g}")
        else:
            self._nonfinite_streak += 1
            self._check_nonfinite_streak(verdict.bad_ranks, verdict.bad_loss_ranks)

    def _apply_step(self, lr_kwargs):
        self._nonfinite_streak = 0
        coef = None
        if self.config.gradient_clipping > 0:
            self._global_grad_norm = global_norm(self.states.grad_norms(), self._norm_groups(),
                                                 self.states.norm_weights(self.topology.tp))
            coef = clip_coefficient(self._global_grad_norm, self.config.gradient_clipping)
        else:  # no clipping: skip the norm and its all-reduces (one more sync point per step)
            self._global_grad_norm = None
        self.states.apply_update(self.optimizer, coef)
        self._step_applied = True
        self.states.publish()
        if self.lr_scheduler is not None:
            self.lr_scheduler.step(**(lr_kwargs or {}))

    def _after_step(self, verdict: "StepVerdict"):
        self.states.zero_grads()
        self.global_steps += 1
        self.global_samples += self.train_batch_size()
        watchdog.set_step(self.global_steps)
        if self.global_steps == 1:  # optimizer states exist from the first step on
            self._log_memory_prediction()
        self._report()
        self.preemption_requested = bool(verdict.preempting)
        if self.preemption_requested and self.config.zerotron.save_on_preemption:
            self.save_checkpoint(self.config.zerotron.save_on_preemption)
            logger.warning(f"preempted (signal on rank(s) {verdict.preempting}): checkpoint saved at step "
                           f"{self.global_steps} in {self.config.zerotron.save_on_preemption}; exiting {EXIT_PREEMPTED}")
            raise SystemExit(EXIT_PREEMPTED)

    # ---- agreement and bad input (see also zerotron/watchdog.py) --------------------------------
    def _agree(self, nonfinite: torch.Tensor | None) -> tuple[list[int], list[int], list[int]]:
        """The step's one host sync: a small all-gather, so that every rank takes the same decision.
        It names the ranks whose gradients hold NaN/Inf, those whose loss did (after the gradient
        reduction every rank's gradients are bad; the loss says where it started), those that
        received SIGTERM/SIGINT, and those that were fed token ids outside the vocabulary (then every
        rank raises BadBatchError before the update)."""
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        flag = lambda t: zero if t is None else t.to(self.device, torch.float64).reshape(())  # noqa: E731
        bad_input = self._bad_input if self._bad_input is not None else (zero, zero)
        mine = torch.stack([flag(nonfinite), flag(self._bad_loss),
                            zero + float(preemption.requested() is not None), flag(bad_input[0]), flag(bad_input[1])])
        self._bad_loss = self._bad_input = None
        every = self.world_comm.all_gather_list(mine) if self.world_size > 1 else [mine]
        rows = torch.stack(every).tolist()  # the sync
        ranks = [[r for r, row in enumerate(rows) if row[i]] for i in range(4)]
        if ranks[3]:
            raise BadBatchError(f"bad input at step {self.global_steps}: token id {int(rows[ranks[3][0]][4])} on "
                                f"rank(s) {ranks[3]} is outside the vocabulary [0, {self._vocab_size}): check the "
                                "tokenizer against the model's vocab_size (the step was not applied)")
        return ranks[0], ranks[1], ranks[2]

    def _check_nonfinite_streak(self, bad_ranks: list[int], bad_loss_ranks: list[int]) -> None:
        limit = self.config.zerotron.max_nonfinite_steps
        where = (f"NaN/Inf loss on rank(s) {bad_loss_ranks}" if bad_loss_ranks else
                 f"NaN/Inf gradients on rank(s) {bad_ranks}")
        logger.warning(f"step {self.global_steps}: {where}; step skipped on every rank "
                       f"({self._nonfinite_streak} in a row, stopping at {limit})")
        if self._nonfinite_streak >= limit:
            raise NonFiniteError(
                f"training stopped at step {self.global_steps}: {limit} consecutive steps had NaN/Inf values "
                f"(last: {where}). The weights are those of the last good step. Lower the learning rate, check "
                "the data, or raise zerotron.max_nonfinite_steps.")

    def _check_inputs(self, args, kwargs):
        """An empty batch is named before the forward runs. Token ids outside the vocabulary (in
        the input ids or the labels) would fail deep inside the embedding or the loss (or read
        garbage on a GPU): in training they are replaced for the forward (ids by 0, labels by the
        ignore index), and the step's agreement (`_agree`) names them on every rank before the
        update, so no host sync is spent per micro-batch; without gradients (evaluation) they are
        named at once. Returns the arguments to call the model with."""
        args, kwargs = list(args), dict(kwargs)
        ids = "input_ids" if "input_ids" in kwargs else 0
        labels = next((k for k in ("labels", "targets") if k in kwargs), 1)
        for where, replacement, allowed in ((ids, 0, None), (labels, IGNORE_INDEX, IGNORE_INDEX)):
            place = kwargs if isinstance(where, str) else dict(enumerate(args))
            tokens = place.get(where)
            if not torch.is_tensor(tokens):
                continue
            if where is ids and tokens.numel() == 0:
                self._bad_input_now(f"an empty batch (shape {list(tokens.shape)}): every micro-batch needs at "
                                    "least one sequence")
            if tokens.is_floating_point() or tokens.dtype == torch.bool or not self._vocab_size:
                continue
            checked = self._outside_vocabulary(tokens, replacement, allowed)
            if isinstance(where, str):
                kwargs[where] = checked
            else:
                args[where] = checked
        return tuple(args), kwargs

    def _outside_vocabulary(self, tokens: torch.Tensor, replacement: int, allowed: int | None) -> torch.Tensor:
        outside = (tokens < 0) | (tokens >= self._vocab_size)
        if allowed is not None:
            outside &= tokens != allowed
        worst = torch.where(outside, tokens, torch.iinfo(tokens.dtype).min).max()
        if not torch.is_grad_enabled():
            if bool(outside.any()):
                self._bad_input_now(f"token id {int(worst)} is outside the vocabulary [0, {self._vocab_size}) (batch "
                                    f"shape {list(tokens.shape)}): check the tokenizer against the model's vocab_size")
            return tokens
        seen = outside.any()
        if self._bad_input is not None:
            seen, worst = seen | self._bad_input[0], torch.maximum(worst.long(), self._bad_input[1])
        self._bad_input = (seen, worst.long())
        return tokens.masked_fill(outside, replacement)

    def _bad_input_now(self, problem: str):
        message = f"bad input at step {self.global_steps} on rank {self.global_rank}: {problem}"
        watchdog.abort(message)  # the other ranks stop with this message instead of waiting
        raise BadBatchError(message)

    def predicted_memory(self) -> dict[str, int]:
        """The planner's model-state bytes for this rank (zerotron.planner.memory), from the
        parameters it trains and the configured ZeRO stage, precision and offload."""
        from ..planner.memory import rank_state_bytes
        z = self.config.zero_optimization
        return rank_state_bytes(self._param_numels, dp=self.grad_comm.size, stage=z.stage,
                                dtype={torch.float32: "fp32", torch.bfloat16: "bf16"}.get(self.dtype, "fp16"),
                                offload_optimizer=z.offload_optimizer is not None and z.offload_optimizer.device == "cpu",
                                offload_param=z.offload_param is not None and z.offload_param.device == "cpu",
                                persistence_threshold=z.stage3_param_persistence_threshold)

    def _log_memory_prediction(self):
        """After the first step: what the planner predicts next to what this rank holds. Gradients
        are held from backward to the step and freed by it, so theirs is the predicted peak alone."""
        predicted, measured = self.predicted_memory(), self.memory_report()
        mib = 2 ** 20
        kept = ("params", "master_weights", "optimizer")
        logger.info(f"rank {self.global_rank} model states: predicted {sum(predicted[k] for k in kept) / mib:.1f} "
                    f"MiB, measured {sum(measured.get(k, 0) for k in kept) / mib:.1f} MiB (" + ", ".join(
                        f"{k} {predicted[k] / mib:.1f}/{measured.get(k, 0) / mib:.1f}" for k in kept) +
                    f"); gradients from backward to the step: predicted {predicted['grads'] / mib:.1f} MiB")

    def _norm_groups(self) -> list:
        """The groups over which squared gradient norms are summed: the ZeRO shards (if any), and
        the model-parallel dimensions, whose ranks hold different parameters."""
        return [self.states.norm_group] + [self.topology.group(d) for d in ("tp", "pp")
                                           if getattr(self.topology, d) > 1]

    def _report(self):
        losses, self._micro_losses = self._micro_losses, []
        print_now = self.global_steps % self.config.steps_per_print == 0
        if not (print_now or self.monitor.enabled) or not losses:
            return
        loss = torch.stack(losses).float().mean().item()
        if self.monitor.enabled:
            events = [("Train/Samples/train_loss", loss, self.global_samples),
                      ("Train/Samples/lr", self.get_lr()[0], self.global_samples)]
            if self.loss_scaler.enabled:
                events.append(("Train/Samples/loss_scale", self.loss_scaler.scale, self.global_samples))
            self.monitor.write(events)
        if print_now:
            elapsed = time.perf_counter() - self._step_start
            self._step_start = time.perf_counter()
            logger.info(f"step={self.global_steps} loss={loss:.4f} lr={self.get_lr()} skipped={self.skipped_steps} "
                        f"samples/s={self.config.steps_per_print * self.train_batch_size() / elapsed:.1f}")
