"""The zero-bubble backward split (zerotron/pipe/backward.py): B gives the input's gradient and no
weight gradient, W then gives the weight gradients of a plain backward, bit for bit, with the
weights' post-accumulate-grad hooks (ZeRO's reduction) firing once each, in W."""

import pytest
import torch
import torch.nn as nn
from parity import make_model

from zerotron.checkpointing import checkpoint
from zerotron.models.gpt import cross_entropy
from zerotron.parallelize import to_pipeline
from zerotron.pipe.backward import backward_input


def _split_matches_plain_backward(loss_of, x, weights, ordered=True):
    plain_order = []
    hooks = [w.register_post_accumulate_grad_hook(plain_order.append) for w in weights]
    loss_of(x).backward()
    for h in hooks:
        h.remove()
    want_x = None if x.grad is None else x.grad.clone()
    want = [w.grad.clone() for w in weights]
    x.grad = None
    for w in weights:
        w.grad = None
    fired = []
    hooks = [w.register_post_accumulate_grad_hook(fired.append) for w in weights]
    got_x, weight_pass = backward_input([loss_of(x)], None, [x], weights)
    assert all(w.grad is None for w in weights) and not fired  # B leaves the weights alone
    weight_pass()
    for h in hooks:
        h.remove()
    assert sorted(map(id, fired)) == sorted(map(id, weights))  # each weight's hook once, in W
    # starting where a plain backward starts (the last layer), so gradient buckets, cut in that
    # order, fill and reduce during W as they do during a plain backward (`ordered`: no weight
    # used at two depths, whose hook a plain backward fires only after its deeper use)
    assert not ordered or fired[0] is plain_order[0]
    if want_x is None:
        assert got_x == [None]
    else:
        assert torch.equal(got_x[0], want_x)
    for w, g in zip(weights, want):
        assert torch.equal(w.grad, g)


@pytest.mark.parametrize("interval", [0, 1, 2])
def test_a_gpt_stage_splits_exactly(interval):
    """The last stage of a 2-stage GPT (2 blocks, norm, head, loss), checkpointed every `interval` layers."""
    stage = to_pipeline(
        make_model(n_layer=4, n_kv_head=4),
        2,
        partition_method="type:_PipeBlock",
        stage_id=1,
        activation_checkpoint_interval=interval,
    )
    labels = torch.randint(0, 256, (2, 16))
    x = torch.randn(2, 16, stage.chunks[0][0][1].config.d_model, requires_grad=True)
    _split_matches_plain_backward(lambda x: cross_entropy(stage(x.clone()), labels), x, list(stage.parameters()))


def test_the_first_stage_defers_its_whole_backward_to_w():
    stage = to_pipeline(make_model(n_layer=4, n_kv_head=4), 2, partition_method="type:_PipeBlock", stage_id=0)
    tokens = torch.randint(0, 256, (2, 16))
    _split_matches_plain_backward(lambda t: stage(t).square().mean(), tokens, list(stage.parameters()))


def test_a_weight_used_at_two_depths_is_counted_once():
    torch.manual_seed(0)
    shared, other = nn.Linear(8, 8), nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    _split_matches_plain_backward(
        lambda x: torch.tanh(shared(torch.tanh(other(torch.tanh(shared(x)))))).sum(),
        x,
        [*shared.parameters(), *other.parameters()],
        ordered=False,
    )


def test_an_output_part_independent_of_the_input():
    torch.manual_seed(0)
    lin, bias = nn.Linear(8, 8), nn.Parameter(torch.randn(8))
    x = torch.randn(4, 8, requires_grad=True)
    _split_matches_plain_backward(lambda x: lin(x).sum() + (bias * 2).sum(), x, [*lin.parameters(), bias])


def test_w_does_not_rerun_the_input_chain_and_recomputes_a_checkpoint_once():
    runs = {"block": 0, "linear": 0, "tanh": 0}

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            runs["block"] += 1
            return self.b(torch.tanh(self.a(x)))

    torch.manual_seed(0)
    blocks = nn.ModuleList(Block() for _ in range(3))
    x = torch.randn(4, 8, requires_grad=True)
    out = checkpoint(blocks[0], x)
    for b in blocks[1:]:
        out = b(out)
    stack, seen = [out.grad_fn], set()  # count the runs of the linear layers' and tanh's backward nodes
    while stack:
        n = stack.pop()
        if n is not None and n not in seen:
            seen.add(n)
            stack += [c for c, _ in n.next_functions]
            kind = "linear" if n.name().startswith("Addmm") else "tanh" if n.name().startswith("Tanh") else None
            if kind:
                n.register_prehook(lambda g, kind=kind: runs.__setitem__(kind, runs[kind] + 1))
    runs["block"] = 0
    _, weight_pass = backward_input([out.square().sum()], None, [x], list(blocks.parameters()))
    after_b = dict(runs)
    weight_pass()
    # B: each of the 6 linear layers' backward once (its input part), and the 3 tanh; W: each linear
    # once more (its weight part), but not the input chain between them (no tanh); the checkpointed
    # block recomputed once per pass
    assert after_b == {"block": 1, "linear": 6, "tanh": 3}
    assert runs == {"block": 2, "linear": 12, "tanh": 3}
