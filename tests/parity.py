"""Shared pieces of the parity tests: one model, one data stream, a plain single-process trainer."""

from __future__ import annotations

import torch

from zerotron.models.gpt import GPT, config_for

SEQ = 16
LR = 1e-3
# Adam divides each element's step by that element's gradient magnitude; where the true gradient
# is ~0 (rare embedding rows, cancelling sums), float rounding from a different summation order (a
# different reduction tree) is amplified towards the learning rate, so weight differences scale
# with LR. A modest LR and eps = 1e-6 keep that amplification below the 1e-5 weight tolerance, so
# the comparison measures the engine rather than Adam's sensitivity.
EPS = 1e-6


def make_model(seed: int = 0, **overrides) -> GPT:
    torch.manual_seed(seed)
    return GPT(config_for("tiny", max_seq_len=SEQ, **overrides))


def global_batches(steps: int, batch: int, seed: int = 1, vocab: int = 256) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Deterministic token batches; targets are the inputs shifted by one."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, vocab, (batch, SEQ + 1), generator=g)
        out.append((tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()))
    return out


def micro_batches(batch, dp_rank: int, dp: int, gas: int):
    """This rank's micro-batches of one global batch: a contiguous block of rows, split in `gas`."""
    x, y = batch
    rows = x.shape[0] // dp
    x, y = x[dp_rank * rows : (dp_rank + 1) * rows], y[dp_rank * rows : (dp_rank + 1) * rows]
    return list(zip(x.chunk(gas), y.chunk(gas)))


def ds_config(micro: int, gas: int, clip: float = 1.0, **extra) -> dict:
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clip,
        "steps_per_print": 10**6,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.95], "eps": EPS, "weight_decay": 0.1}},
        **extra,
    }


def param_groups(model):
    """Two groups, as the Hugging Face Trainer builds them: matrices decay, vectors don't."""
    params = list(model.parameters())
    return [
        {"params": [p for p in params if p.dim() > 1], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() <= 1], "weight_decay": 0.0},
    ]


def hf_loss(model, x, y):
    """A Transformers causal LM's loss on tokens `x` (it shifts the labels itself)."""
    return model(input_ids=x, labels=x).loss


def reference_training(
    batches,
    clip: float = 1.0,
    norms: list | None = None,
    groups=None,
    model=None,
    forward=None,
    lr: float = LR,
    weight_decay: float = 0.1,
    **model_overrides,
):
    """Plain PyTorch on one process: the ground truth every strategy must reproduce. `norms`, if
    given, receives each step's gradient norm before clipping; `groups(model)` gives the optimizer's
    parameter groups (default: one); `model` replaces the seeded reference GPT, and
    `forward(model, x, y)` its loss (e.g. `hf_loss`)."""
    model = model if model is not None else make_model(**model_overrides)
    # The fused kernel, as the engine uses: the comparison then isolates the engine from
    # differences between torch's AdamW implementations (~3e-6 on these weights).
    opt = torch.optim.AdamW(
        groups(model) if groups else model.parameters(),
        lr=lr,
        betas=(0.9, 0.95),
        eps=EPS,
        weight_decay=weight_decay,
        fused=True,
    )
    losses = []
    for x, y in batches:
        loss = forward(model, x, y) if forward else model(x, y)
        loss.backward()
        if clip:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            if norms is not None:
                norms.append(norm.item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_losses_close(got, want, rtol: float):
    assert len(got) == len(want)
    for step, (a, b) in enumerate(zip(got, want)):
        assert abs(a - b) <= rtol * abs(b), f"step {step}: loss {a} vs reference {b} (rel {abs(a - b) / abs(b):.2e})"


def max_weight_diff(state, reference) -> float:
    assert state.keys() == reference.keys()
    return max((state[k].float() - reference[k].float()).abs().max().item() for k in reference)


class Dense(torch.nn.Module):
    """A pipeline layer for LayerSpec tests: tanh(linear(x))."""

    def __init__(self, d):
        super().__init__()
        self.lin = torch.nn.Linear(d, d)

    def forward(self, x):
        return torch.tanh(self.lin(x))
