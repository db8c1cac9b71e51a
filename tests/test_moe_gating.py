"""MoE gating (zerotron/moe/gating.py, issue 31): capacity, dropping, slots, weights, l_aux and
exp_counts on router logits whose decisions are known by hand. Against DeepSpeed 0.19.8's gating on
random logits and the same random stream (tools/moe_gating_compare.py, DeepSpeed's interpreter):
24 cases bit-identical."""

import pytest
import torch

from zerotron.moe import dense, route, top2gating


def _logits(choices, experts, second=None):
    """Router logits whose softmax argmax per token is `choices` (and runner-up `second`)."""
    x = torch.zeros(len(choices), experts)
    x[torch.arange(len(choices)), torch.tensor(choices)] = 4.0
    if second is not None:
        x[torch.arange(len(choices)), torch.tensor(second)] = 2.0
    return x


def test_top1_drops_past_capacity_and_counts_before_dropping():
    x = _logits([0, 0, 0, 1, 2, 3, 1, 2], 4)  # capacity ceil(8 / 4 x 1) = 2: one of expert 0's three goes
    r = route(x, 1, capacity_factor=1.0, min_capacity=1, use_rts=False)
    assert r.capacity == 2 and r.counts.tolist() == [3, 2, 2, 1]
    assert (r.experts[0] == -1).sum() == 1 and r.experts[0][3:].tolist() == [1, 2, 3, 1, 2]
    kept = r.experts[0] >= 0
    for e in range(4):  # each kept token in its own slot, in token order
        assert sorted(r.slots[0][kept & (r.experts[0] == e)].tolist()) == list(range(int((r.experts[0] == e).sum())))
    probs = torch.softmax(x, 1).max(1).values
    torch.testing.assert_close(r.weights[0], probs * kept)  # top-1 weights are the probabilities, unnormalized


def test_dropless_capacity_is_the_busiest_expert_agreed_over_ranks():
    x = _logits([0, 0, 0, 1, 2, 3, 1, 2], 4)
    r = route(x, 1, min_capacity=1, drop_tokens=False, use_rts=False)
    assert r.capacity == 3 and (r.experts[0] >= 0).all()
    r = route(x, 2, min_capacity=1, drop_tokens=False, agree_capacity=lambda c: c + 5, second_expert_sampling=False)
    assert r.capacity == r.counts.max().item() + 5 and (r.experts >= 0).all()


def test_top2_second_choices_queue_after_every_first_and_weights_normalize():
    x = _logits([0, 1, 0, 1], 4, second=[1, 0, 2, 3])
    r = route(x, 2, capacity_factor=1.0, min_capacity=1, second_expert_sampling=False)
    assert r.capacity == 2  # ceil(4 / 4 x 2 x 1)
    assert r.experts[0].tolist() == [0, 1, 0, 1] and r.slots[0].tolist() == [0, 0, 1, 1]
    # second choices of experts 0 and 1 come after their two first choices: past capacity 2, dropped
    assert r.experts[1].tolist() == [-1, -1, 2, 3] and r.slots[1][2:].tolist() == [0, 0]
    torch.testing.assert_close(r.weights[0][:2], torch.ones(2))  # alone: its whole weight
    torch.testing.assert_close(r.weights.sum(0), torch.ones(4))
    assert r.counts.tolist() == [3, 3, 1, 1]


def test_a_uniform_router_has_unit_aux_loss():
    for k in (1, 2, 3):  # mean probability 1/E everywhere: l_aux's normalizations make it 1 for every k
        r = route(torch.zeros(8, 4), k, min_capacity=1, use_rts=False, second_expert_sampling=False)
        assert abs(r.l_aux.item() - 1.0) < 1e-6, (k, r.l_aux)


def test_deepspeeds_dense_tensors_are_the_route_table():
    logits = torch.randn(16, 4, generator=torch.Generator().manual_seed(0))
    r = route(logits, 2, min_capacity=1, second_expert_sampling=False)
    l_aux, combine, dispatch, counts = top2gating(logits, 1.0, 1, top2_2nd_expert_sampling=False)
    assert combine.shape == (16, 4, r.capacity) and torch.equal(counts, r.counts) and l_aux == r.l_aux
    for j, t in zip(*torch.nonzero(r.experts >= 0, as_tuple=True)):
        assert combine[t, r.experts[j, t], r.slots[j, t]] == r.weights[j, t]
    assert dispatch.sum() == (r.experts >= 0).sum() and torch.equal(dispatch, combine.bool())
    torch.testing.assert_close(dense(r, 4)[0], combine)


def test_bad_gating_arguments_are_named():
    with pytest.raises(ValueError, match="k 5: each token goes to between 1 and the 4 experts"):
        route(torch.zeros(8, 4), 5)
    with pytest.raises(ValueError, match="3 tokens and min_capacity 8"):
        route(torch.zeros(3, 4), 1)
    with pytest.raises(ValueError, match="drop_policy 'random'"):
        route(torch.zeros(8, 4), 3, drop_policy="random", min_capacity=1)


def _dropless_over_ranks():
    import torch.distributed as dist

    from zerotron.moe import top1gating

    rank = dist.get_rank()
    choices = [0] * (3 + 2 * rank) + [1, 2, 3]  # expert 0's count differs: 3 on rank 0, 5 on rank 1
    x = torch.zeros(len(choices), 4)
    x[torch.arange(len(choices)), torch.tensor(choices)] = 4.0
    return top1gating(x, 1.0, 1, drop_tokens=False, use_rts=False, ep_group=dist.group.WORLD)[1].shape[2]


def test_dropless_capacity_is_agreed_over_the_expert_parallel_group():
    """DeepSpeed's all-reduce (MAX) over ep_group: every rank's buffers as large as the busiest rank's."""
    from distributed import run_ranks

    assert run_ranks(_dropless_over_ranks, 2) == [5, 5]
