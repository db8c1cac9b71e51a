"""The engine's optimizer step and what it agrees on: the `Engine` methods that turn a boundary
backward's gradients into an update (or a skipped step), from the step's record of its losses and
inputs. A mixin of engine.Engine, in a file of its own so the step reads top to bottom."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .. import preemption, watchdog
from ..errors import EXIT_PREEMPTED, BadBatchError, ConfigError, NonFiniteError
from ..log import logger
from ..precision import clip_coefficient, global_norm


@dataclass
class StepRecord:
    """What one optimizer step gathers over its micro-batches. The engine starts a new record in
    one place (`_take_record`): when a step begins, and when it stands at a boundary after a load."""

    losses: list = field(default_factory=list)  # each micro-batch's loss, detached
    bad_loss: torch.Tensor | None = None  # did any micro-batch's loss hold NaN/Inf? (a tensor: no sync)
    bad_input: tuple | None = None  # token ids outside the vocabulary: (any?, the largest such)

    def add_loss(self, loss: torch.Tensor):
        self.losses.append(loss.detach())
        bad = ~torch.isfinite(loss.detach())
        self.bad_loss = bad if self.bad_loss is None else self.bad_loss | bad

    def saw_input(self, outside: torch.Tensor, worst: torch.Tensor):
        if self.bad_input is not None:
            outside, worst = outside | self.bad_input[0], torch.maximum(worst, self.bad_input[1])
        self.bad_input = (outside, worst)


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
        if self._unused_check is not None:  # ignore_unused_parameters: false (zero/unused.py)
            self._unused_check.verify()
        record = self._take_record()
        verdict = self._agree_on_step(record)
        if verdict.overflow:
            self._skip_step(verdict)
        else:
            self._apply_step(lr_kwargs)
        self._after_step(verdict, record)

    def _take_record(self) -> StepRecord:
        """This step's record; the next micro-batches write to a new one."""
        record, self._record = self.__dict__.get("_record"), StepRecord()
        return record

    def _require_optimizer(self):
        if getattr(self.optimizer, "placeholder", False):
            raise ConfigError(
                "optimizer",
                None,
                "this engine was built without an optimizer (for inference or "
                "evaluation), so it cannot step: add an 'optimizer' section to the config or pass "
                "optimizer= to zerotron.initialize",
            )

    def _agree_on_step(self, record: StepRecord) -> StepVerdict:
        """Unscale the gradients, check them, and agree with every other rank (one host sync)."""
        scaled = self.loss_scaler.enabled
        nonfinite = self.states.unscale_and_check(1.0 / self.loss_scaler.scale if scaled else 1.0)
        bad_ranks, bad_loss_ranks, preempting = self._agree(nonfinite, record)  # every rank skips, or none does
        verdict = StepVerdict(bad_ranks, bad_loss_ranks, preempting, previous_scale=self.loss_scaler.scale)
        self.optimizer.overflow = verdict.overflow  # DeepSpeed's fp16 optimizers expose it; scripts read it
        if scaled:
            self.loss_scaler.update(verdict.overflow)
        return verdict

    def _skip_step(self, verdict: StepVerdict):
        self.skipped_steps += 1
        if self.loss_scaler.enabled:  # dynamic loss scaling: overflow is expected now and then
            logger.warning(
                f"step {self.global_steps}: fp16 gradients overflowed, step skipped; "
                f"loss scale {verdict.previous_scale:g} -> {self.loss_scaler.scale:g}"
            )
        else:
            self._nonfinite_streak += 1
            self._check_nonfinite_streak(verdict.bad_ranks, verdict.bad_loss_ranks)

    def _apply_step(self, lr_kwargs):
        self._nonfinite_streak = 0
        coef = None
        if self.config.gradient_clipping > 0:
            self._global_grad_norm = global_norm(
                self.states.grad_norms(), self._norm_groups(), self.states.norm_weights(self.topology.tp)
            )
            coef = clip_coefficient(self._global_grad_norm, self.config.gradient_clipping)
        else:  # no clipping: skip the norm and its all-reduces (one more sync point per step)
            self._global_grad_norm = None
        self.states.apply_update(self.optimizer, coef)
        self._step_applied = True
        self.states.publish()
        if self.lr_scheduler is not None:
            self.lr_scheduler.step(**(lr_kwargs or {}))

    def _after_step(self, verdict: StepVerdict, record: StepRecord):
        self.states.zero_grads()
        self.global_steps += 1
        self.global_samples += self.train_batch_size()
        watchdog.set_step(self.global_steps)
        self.reporter.after_step(self, record.losses)
        self.preemption_requested = bool(verdict.preempting)
        if self.preemption_requested and self.config.zerotron.save_on_preemption:
            self.save_checkpoint(self.config.zerotron.save_on_preemption)
            logger.warning(
                f"preempted (signal on rank(s) {verdict.preempting}): checkpoint saved at step "
                f"{self.global_steps} in {self.config.zerotron.save_on_preemption}; exiting {EXIT_PREEMPTED}"
            )
            raise SystemExit(EXIT_PREEMPTED)

    # ---- agreement and bad input (see also zerotron/watchdog.py) --------------------------------
    def _agree(self, nonfinite: torch.Tensor | None, record: StepRecord) -> tuple[list[int], list[int], list[int]]:
        """The step's one host sync: a small all-gather, so that every rank takes the same decision.
        It names the ranks whose gradients hold NaN/Inf, those whose loss did (after the gradient
        reduction every rank's gradients are bad; the loss says where it started), those that
        received SIGTERM/SIGINT, and those that were fed token ids outside the vocabulary (then every
        rank raises BadBatchError before the update)."""
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        flag = lambda t: zero if t is None else t.to(self.device, torch.float64).reshape(())  # noqa: E731
        bad_input = record.bad_input if record.bad_input is not None else (zero, zero)
        mine = torch.stack(
            [
                flag(nonfinite),
                flag(record.bad_loss),
                zero + float(preemption.requested() is not None),
                flag(bad_input[0]),
                flag(bad_input[1]),
            ]
        )
        every = self.world_comm.all_gather_list(mine) if self.world_size > 1 else [mine]
        rows = torch.stack(every).tolist()  # the sync
        ranks = [[r for r, row in enumerate(rows) if row[i]] for i in range(4)]
        if ranks[3]:
            raise BadBatchError(
                f"bad input at step {self.global_steps}: token id {int(rows[ranks[3][0]][4])} on "
                f"rank(s) {ranks[3]} is outside the vocabulary [0, {self.input_guard.vocab_size}): check the "
                "tokenizer against the model's vocab_size (the step was not applied)"
            )
        return ranks[0], ranks[1], ranks[2]

    def _check_nonfinite_streak(self, bad_ranks: list[int], bad_loss_ranks: list[int]) -> None:
        limit = self.config.zerotron.max_nonfinite_steps
        where = (
            f"NaN/Inf loss on rank(s) {bad_loss_ranks}"
            if bad_loss_ranks
            else f"NaN/Inf gradients on rank(s) {bad_ranks}"
        )
        logger.warning(
            f"step {self.global_steps}: {where}; step skipped on every rank "
            f"({self._nonfinite_streak} in a row, stopping at {limit})"
        )
        if self._nonfinite_streak >= limit:
            raise NonFiniteError(
                f"training stopped at step {self.global_steps}: {limit} consecutive steps had NaN/Inf values "
                f"(last: {where}). The weights are those of the last good step. Lower the learning rate, check "
                "the data, or raise zerotron.max_nonfinite_steps."
            )

    def _norm_groups(self) -> list:
        """The groups over which squared gradient norms are summed: the ZeRO shards (if any), and
        the model-parallel dimensions, whose ranks hold different parameters."""
        return [self.states.norm_group] + [
            self.topology.group(d) for d in ("tp", "pp") if getattr(self.topology, d) > 1
        ]
