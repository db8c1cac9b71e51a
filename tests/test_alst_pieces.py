"""ALST's pieces one by one (issue 30): the batch split (labels shifted before it, lengths padded to a
multiple of sp, positions added), the tiled MLP, loss and compute (the gradients of the untiled
function however the result is scaled afterwards, and no tensor as large as the untiled one's
widest), and the errors Ulysses for Transformers gives instead of training wrong."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from distributed import RankError, run_ranks
from torch.utils._python_dispatch import TorchDispatchMode

from zerotron.compat import sequence_parallel as ulysses_sp
from zerotron.long_context.hf_batches import shard_batch


def test_labels_are_shifted_before_the_split_and_odd_lengths_padded():
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    batch = {"input_ids": ids, "labels": torch.tensor([[-100, 6, 7, 8, 9]]), "attention_mask": torch.ones(1, 5)}
    parts = [shard_batch(batch, r, 2) for r in range(2)]
    joined = {k: torch.cat([p[k] for p in parts], dim=1) for k in parts[0]}
    assert joined["input_ids"].tolist() == [[5, 6, 7, 8, 9, 0]]
    assert joined["shift_labels"].tolist() == [[6, 7, 8, 9, -100, -100]]  # token i's target is token i+1
    assert joined["position_ids"].tolist() == [[0, 1, 2, 3, 4, 5]]
    assert joined["attention_mask"].tolist() == [[1, 1, 1, 1, 1, 0]]
    assert "labels" not in joined and parts[0]["input_ids"].tolist() == [[5, 6, 7]]


def test_a_tensor_that_is_not_split_along_the_sequence_is_named():
    batch = {"input_ids": torch.zeros(2, 6, dtype=torch.long), "weights": torch.ones(2)}
    with pytest.raises(ValueError, match=r"batch\['weights'\] has shape \(2,\)"):
        shard_batch(batch, 0, 2)


class _Widest(TorchDispatchMode):
    """The most bytes any one tensor produced by an operation takes."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.bytes = max(self.bytes, t.numel() * t.element_size())
        return out


class _MLP(nn.Module):
    def __init__(self, hidden=16, inner=128):
        super().__init__()
        torch.manual_seed(0)
        self.gate_proj, self.up_proj = nn.Linear(hidden, inner), nn.Linear(hidden, inner)
        self.down_proj = nn.Linear(inner, hidden)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def _grads_and_widest(fn, module, *inputs):
    module.zero_grad()
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    with _Widest() as widest:
        (3.0 * fn(*leaves)).backward()  # a scale applied after the tiled function must reach every gradient
    grads = [t.grad for t in leaves if t.requires_grad] + [p.grad.clone() for p in module.parameters()]
    return grads, widest.bytes


def _assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


def test_tiled_mlp_gives_the_mlp_gradients_from_one_slice_at_a_time():
    mlp, x = _MLP(), torch.randn(2, 64, 16)
    want, widest = _grads_and_widest(lambda x: mlp(x).pow(2).mean(), mlp, x)
    tiled = lambda x: ulysses_sp.TiledMLP.apply(lambda self, h: self(h), mlp, x, 4, list(mlp.parameters()))  # noqa: E731
    got, tiled_widest = _grads_and_widest(lambda x: tiled(x).pow(2).mean(), mlp, x)
    _assert_same(got, want)
    assert tiled_widest <= widest / 4 * 1.05, (tiled_widest, widest)  # the 8x-wide activations, a quarter at a time


def test_tiled_loss_never_holds_the_whole_sequence_logits():
    head, vocab = nn.Linear(16, 512, bias=False), 512
    x, y = torch.randn(2, 64, 16), torch.randint(0, vocab, (2, 64))
    y[0, :10] = -100

    def loss_fn(self, h, t):
        return F.cross_entropy(self(h).float(), t, ignore_index=-100, reduction="sum")

    whole = lambda h, t: loss_fn(head, h.flatten(0, 1), t.flatten())  # noqa: E731
    want, widest = _grads_and_widest(whole, head, x, y)
    tiled = lambda h, t: ulysses_sp.TiledFusedLogitsLoss.apply(loss_fn, head, h, t, None, 8, [head.weight], "sum")  # noqa: E731
    got, tiled_widest = _grads_and_widest(tiled, head, x, y)
    _assert_same(got, want)
    assert tiled_widest <= widest / 8 * 1.05, (tiled_widest, widest)


def test_sequence_tiled_compute_reduces_like_the_untiled_function():
    mlp, x = _MLP(), torch.randn(2, 30, 16)
    for reduction, reduce in (("mean", torch.mean), ("sum", torch.sum), (None, lambda t: t)):
        want, _ = _grads_and_widest(lambda h: reduce(mlp(h)).sum(), mlp, x)
        tiled = lambda h, r=reduction: ulysses_sp.sequence_tiled_compute(  # noqa: E731
            lambda hidden: mlp(hidden), 30, 4, {"hidden": h}, {}, "hidden", list(mlp.parameters()), 1, r
        )
        got, _ = _grads_and_widest(lambda h: tiled(h).sum(), mlp, x)
        _assert_same(got, want)


def _attention_errors():
    import transformers  # noqa: F401

    from tools.alst_script import build_model
    from zerotron.long_context import mpu

    errors = []
    model = build_model("sdpa")
    for call in (
        lambda: ulysses_sp.UlyssesSPAttentionHF.register_with_transformers(model, "eager", 2, 1),
        lambda: ulysses_sp.UlyssesSPAttentionHF.register_with_transformers(build_model("eager"), "eager", 2, 1),
        lambda: ulysses_sp.UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", 2, 1, 31, False),
        lambda: ulysses_sp.UlyssesSPAttentionHF(None, 1, 3, 8, 3, 2, mpu.get_sequence_parallel_group(), True),
    ):
        try:
            call()
            errors.append(None)
        except (ValueError, RankError) as e:
            errors.append(str(e))
    return errors


def test_what_ulysses_cannot_split_is_refused_by_name():
    for errors in run_ranks(_attention_errors, 2):
        mismatch, eager, length, heads = errors
        assert "is not the model's attn_implementation 'sdpa'" in mismatch
        assert "'eager' masks only through a 4-D attention mask" in eager
        assert "seq_length 31 is not a multiple of sequence_parallel_size 2" in length
        assert "3 attention heads cannot be dealt out to sequence_parallel_size 2" in heads
