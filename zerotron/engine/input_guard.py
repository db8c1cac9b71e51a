"""What the engine checks of a batch before the model sees it. An empty batch is named before the
forward runs. Token ids outside the vocabulary (in the input ids or the labels) would fail deep
inside the embedding or the loss (or read garbage on a GPU): in training they are replaced for the
forward (ids by 0, labels by the ignore index) and kept in the step's record, so the step's
agreement names them on every rank before the update and no host sync is spent per micro-batch;
without gradients (evaluation) they are named at once."""

from __future__ import annotations

import torch

from .. import watchdog
from ..errors import BadBatchError

IGNORE_INDEX = -100  # the label PyTorch's cross_entropy and Transformers' losses skip


class InputGuard:
    def __init__(self, vocab_size: int | None):
        self.vocab_size = vocab_size

    def check(self, args, kwargs, record, where: str):
        """The arguments to call the model with; `record` (the step's StepRecord) keeps what was
        replaced, `where` ("step N on rank R") names the place in an error."""
        args, kwargs = list(args), dict(kwargs)
        ids = "input_ids" if "input_ids" in kwargs else 0
        labels = next((k for k in ("labels", "targets") if k in kwargs), 1)
        for at, replacement, allowed in ((ids, 0, None), (labels, IGNORE_INDEX, IGNORE_INDEX)):
            place = kwargs if isinstance(at, str) else dict(enumerate(args))
            tokens = place.get(at)
            if not torch.is_tensor(tokens):
                continue
            if at is ids and tokens.numel() == 0:
                self._refuse(
                    where, f"an empty batch (shape {list(tokens.shape)}): every micro-batch needs at least one sequence"
                )
            if tokens.is_floating_point() or tokens.dtype == torch.bool or not self.vocab_size:
                continue
            checked = self._outside_vocabulary(tokens, replacement, allowed, record, where)
            if isinstance(at, str):
                kwargs[at] = checked
            else:
                args[at] = checked
        return tuple(args), kwargs

    def _outside_vocabulary(
        self, tokens: torch.Tensor, replacement: int, allowed: int | None, record, where: str
    ) -> torch.Tensor:
        outside = (tokens < 0) | (tokens >= self.vocab_size)
        if allowed is not None:
            outside &= tokens != allowed
        worst = torch.where(outside, tokens, torch.iinfo(tokens.dtype).min).max()
        if not torch.is_grad_enabled():
            if bool(outside.any()):
                self._refuse(
                    where,
                    f"token id {int(worst)} is outside the vocabulary [0, {self.vocab_size}) (batch "
                    f"shape {list(tokens.shape)}): check the tokenizer against the model's vocab_size",
                )
            return tokens
        record.saw_input(outside.any(), worst.long())
        return tokens.masked_fill(outside, replacement)

    @staticmethod
    def _refuse(where: str, problem: str):
        message = f"bad input at {where}: {problem}"
        watchdog.abort(message)  # the other ranks stop with this message instead of waiting
        raise BadBatchError(message)
