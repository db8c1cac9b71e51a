"""Pipeline schedules and partitions, checked without processes: order of operations, deadlock
freedom, in-flight activations, message order and the ideal bubble."""

import itertools

import pytest
import torch.nn as nn

from zerotron.pipe import LayerSpec, PipelineModule, TiedLayerSpec, build_schedule, simulate, theoretical_bubble
from zerotron.pipe.partition import by_type, partition, uniform
from zerotron.pipe.schedule import Action

CASES = [
    (name, p, m, v)
    for name, v in (("gpipe", 1), ("1f1b", 1), ("gpipe", 2), ("interleaved", 2), ("interleaved", 3), ("zb-h1", 1))
    for p, m in itertools.product((1, 2, 3, 4, 8), (1, 2, 4, 8, 16))
    if name != "interleaved" or m % p == 0
]


@pytest.mark.parametrize("name,p,m,v", CASES)
def test_every_micro_batch_runs_forward_then_backward_once_per_chunk(name, p, m, v):
    schedule = build_schedule(name, p, m, v)
    kinds = "FBW" if name == "zb-h1" else "FB"  # zero bubble: the weight gradients are W actions
    for actions in schedule:
        assert sorted((a.kind, a.chunk, a.micro) for a in actions) == sorted(
            (k, c, i) for k in kinds for c in range(v) for i in range(m)
        )
        seen = set()
        for a in actions:  # on one stage, each chunk's backward comes after its forward, W after B
            if a.kind in "BW":
                assert ("F" if a.kind == "B" else "B", a.chunk, a.micro) in seen
            seen.add((a.kind, a.chunk, a.micro))


@pytest.mark.parametrize("name,p,m,v", CASES)
def test_no_stage_waits_forever_and_messages_arrive_in_send_order(name, p, m, v):
    sim = simulate(build_schedule(name, p, m, v), chunks=v)  # raises if some stage waits forever
    # Without tags (NCCL) messages between two ranks match by order: both sides must agree on it.
    assert sim.messages == sim.received


@pytest.mark.parametrize("name,p,m,v", [c for c in CASES if (c[0] != "gpipe" or c[3] == 1) and c[0] != "zb-h1"])
def test_ideal_bubble_matches_theory(name, p, m, v):
    sim = simulate(build_schedule(name, p, m, v), chunks=v, t_forward=1.0, t_backward=2.0)
    expected = theoretical_bubble(p, m, v)
    for bubble in sim.bubble:
        assert bubble == pytest.approx(expected, abs=1e-9)


@pytest.mark.parametrize("p,m", list(itertools.product((2, 3, 4, 8), (1, 2, 3, 4, 8, 16))))
def test_zb_h1_idles_a_third_of_1f1b_with_equal_passes(p, m):
    """t_F = t_B = t_W: the zero-bubble paper's (p - 1)(t_F + t_B - t_W) idle time per stage,
    against 1F1B's (p - 1)(t_F + t_B + t_W), once there are at least as many micro-batches as stages."""
    zb = simulate(build_schedule("zb-h1", p, m), t_forward=1.0, t_backward=2.0, t_weight=1.0)
    one = simulate(build_schedule("1f1b", p, m), t_forward=1.0, t_backward=2.0)
    idle_zb = [zb.makespan - b for b in zb.busy]
    idle_one = [one.makespan - b for b in one.busy]
    if m >= p:
        assert idle_zb == pytest.approx([p - 1] * p) and idle_one == pytest.approx([3 * (p - 1)] * p)
        assert theoretical_bubble(p, m, schedule="zb-h1") == pytest.approx((p - 1) / (3 * m + p - 1))
    assert all(z < o for z, o in zip(idle_zb, idle_one))  # fewer micro-batches: still less idle
    assert max(zb.bubble) == pytest.approx(theoretical_bubble(p, m, schedule="zb-h1"))
    # "H1": no stage holds more micro-batches' activations than 1F1B's first stage
    assert max(zb.max_in_flight) == max(one.max_in_flight) == min(p, m)


def test_zb_h1_fills_the_cool_down_with_deferred_weight_passes():
    # stage s runs its W's s steps late; the last stage hands gradients back as fast as B allows
    assert [str(a) for a in build_schedule("zb-h1", 2, 4)[1]] == [
        "F0.0",
        "B0.0",
        "F0.1",
        "B0.1",
        "W0.0",
        "F0.2",
        "B0.2",
        "W0.1",
        "F0.3",
        "B0.3",
        "W0.2",
        "W0.3",
    ]
    assert [a.kind for a in build_schedule("zb-h1", 2, 4)[0]] == list("FFBWFBWFBWBW")
    # unequal passes (given per stage): the paper's m(t_F + t_B + t_W) + (p - 1)(t_F + t_B - t_W)
    t_f, t_b, t_w = 1.0, 1.5, 0.5
    sim = simulate(build_schedule("zb-h1", 2, 4), t_forward=[t_f, t_f], t_backward=[t_b + t_w] * 2, t_weight=t_w)
    assert sim.makespan == pytest.approx(4 * (t_f + t_b + t_w) + (t_f + t_b - t_w))


def test_zb_h1_is_refused_with_model_chunks():
    from zerotron.errors import ConfigError

    with pytest.raises(ConfigError, match="pipeline.schedule.*num_virtual_stages=1"):
        build_schedule("zb-h1", 2, 4, 2)


@pytest.mark.parametrize("p,m", list(itertools.product((1, 2, 4, 8), (1, 3, 8, 16))))
def test_one_f_one_b_bounds_activations_in_flight(p, m):
    sim = simulate(build_schedule("1f1b", p, m))
    for s, peak in enumerate(sim.max_in_flight):
        assert peak == min(p - s, m)
    assert simulate(build_schedule("gpipe", p, m)).max_in_flight == [m] * p


def test_interleaved_bounds_activations_in_flight():
    p, m, v = 4, 16, 2
    sim = simulate(build_schedule("interleaved", p, m, v), chunks=v)
    for s, peak in enumerate(sim.max_in_flight):
        assert peak <= (p - s - 1) * 2 + (v - 1) * p + 1 < m * v


def test_interleaved_is_refused_without_model_chunks():
    from zerotron.errors import ConfigError

    with pytest.raises(ConfigError, match="pipeline.schedule.*num_virtual_stages=2 or more"):
        build_schedule("interleaved", 2, 4, 1)


def test_interleaved_needs_whole_rounds_of_micro_batches():
    with pytest.raises(ValueError, match="multiple of the pipeline stages"):
        build_schedule("interleaved", 4, 6, 2)
    with pytest.raises(ValueError, match="unknown pipeline schedule"):
        build_schedule("zigzag", 2, 2)


def test_a_broken_schedule_is_reported_as_a_deadlock():
    schedule = build_schedule("1f1b", 2, 2)
    schedule[1] = list(reversed(schedule[1]))  # the last stage runs a backward before any forward
    with pytest.raises(RuntimeError, match="before its forward|deadlocks"):
        simulate(schedule)
    schedule = build_schedule("zb-h1", 2, 2)
    schedule[0] = [a for a in schedule[0] if a.kind != "W"] + [a for a in schedule[0] if a.kind == "W"][::-1][:1]
    with pytest.raises(RuntimeError, match="without their weight pass"):
        simulate(schedule)
    schedule = build_schedule("zb-h1", 2, 2)
    schedule[1].insert(0, schedule[1].pop(schedule[1].index(next(a for a in schedule[1] if a.kind == "W"))))
    with pytest.raises(RuntimeError, match="before its backward"):
        simulate(schedule)


# ---- partitions ---------------------------------------------------------------------------------
# Boundaries DeepSpeed 0.19's partition_balanced gives for these weights (computed with its own
# function; 3000 random weight lists agreed with ours): an embedding, equal blocks, a head.
DEEPSPEED_CUTS = [
    (([4096, 800, 800, 800, 800, 4160], 2), [0, 3, 6]),
    (([4096, 800, 800, 800, 800, 4160], 3), [0, 1, 5, 6]),
    (([4096, 1200, 1200, 1200, 1200, 1200, 1200, 64], 4), [0, 1, 3, 5, 8]),
    (([0, 3, 3, 3, 3, 0], 2), [0, 3, 6]),
]


@pytest.mark.parametrize("weights_parts,cuts", DEEPSPEED_CUTS)
def test_parameters_partition_cuts_where_deepspeed_does(weights_parts, cuts):
    assert partition(*weights_parts) == cuts


def test_partition_balances_the_parts():
    assert partition([10, 1, 1, 1, 1, 10], 2) == [0, 3, 6]
    assert partition([5, 4, 4, 4, 4, 9], 3) == [0, 2, 5, 6]
    assert partition([1] * 8, 4) == [0, 2, 4, 6, 8]
    assert uniform(6, 4) == [0, 2, 4, 5, 6]
    with pytest.raises(ValueError, match="cannot split 3 layers into 4"):
        partition([1, 1, 1], 4)


def test_partition_by_type_starts_parts_at_matching_layers():
    names = ["Embedding", "Block", "Block", "Block", "Block", "Norm", "Head"]
    assert by_type(names, "block", 2) == [0, 3, 7]
    assert by_type(names, "^Block$", 4) == [0, 2, 3, 4, 7]
    with pytest.raises(ValueError, match="matches 4 layers"):
        by_type(names, "block", 5)


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        return self.lin(x)


def _layers():
    return [
        TiedLayerSpec("emb", nn.Embedding, 100, 16),
        *[LayerSpec(Block, 16) for _ in range(6)],
        TiedLayerSpec("emb", nn.Embedding, 100, 16, forward_fn=lambda m, x: x @ m.weight.t()),
    ]


@pytest.mark.parametrize(
    "method,bounds", [("uniform", [0, 2, 4, 6, 8]), ("type:block", [0, 3, 5, 6, 8]), ("parameters", [0, 1, 4, 7, 8])]
)
def test_partition_methods_of_pipeline_module(method, bounds):
    m = PipelineModule(_layers(), num_stages=4, partition_method=method, stage_id=0)
    assert m.parts == bounds
    assert m.tie_stages == {"emb": [0, 3]}


def test_each_stage_builds_only_its_layers_and_virtual_stages_interleave():
    m = PipelineModule(_layers(), num_stages=2, num_virtual_stages=2, partition_method="uniform", stage_id=1)
    assert m.parts == [0, 2, 4, 6, 8]
    assert [[i for i, _ in chunk] for chunk in m.chunks] == [[2, 3], [6, 7]]
    assert sorted(m.layers.keys()) == ["2", "3", "6"] and list(m.tied.keys()) == ["emb"]
    with pytest.raises(ValueError, match="partition_method"):
        PipelineModule(_layers(), num_stages=2, partition_method="best", stage_id=0)


# ---- point-to-point under NCCL's rules --------------------------------------------------------------
def _stalls(schedule, p: int, v: int, group_of, ahead: bool = True) -> bool:
    """Run `schedule` with NCCL's point-to-point rules: on each rank a process group's operations
    complete in the order they were posted, each only when its peer's matching operation is the
    next one there; a stage posts its sends after each computation and waits for a receive before
    the computation that needs it. `ahead`: receives are posted as the engine's p2p.Inbox posts
    them (per incoming flow, the next message as soon as the previous one was read and, for a
    gradient, its forward has run); else each just before its computation. True when the stages
    wait on each other forever."""
    from zerotron.pipe.schedule import location, virtual_stage

    last = p * v - 1
    programs = []
    for s, actions in enumerate(schedule):
        program = []
        for a in actions:
            vs = virtual_stage(s, a.chunk, p)
            if a.kind == "F":
                program.append(
                    (("act", vs, a.micro) if vs > 0 else None, [("act", vs + 1, a.micro)] if vs < last else [])
                )
            elif a.kind == "B":
                program.append(
                    (("grad", vs, a.micro) if vs < last else None, [("grad", vs - 1, a.micro)] if vs > 0 else [])
                )
            else:  # W: no messages
                program.append((None, []))
        programs.append(program)
    sender = lambda m: location(m[1] - 1 if m[0] == "act" else m[1] + 1, p)[0]  # noqa: E731
    receiver = lambda m: location(m[1], p)[0]  # noqa: E731
    reads = [{} for _ in range(p)]  # per rank: incoming flow -> the messages it reads, in order
    for r, program in enumerate(programs):
        for need, _ in program:
            if need is not None:
                reads[r].setdefault((need[0], sender(need)), []).append(need)
    pc, queues, posted, done, read, forwards = [0] * p, {}, set(), set(), set(), set()

    def post(r, need):
        queues.setdefault((r, group_of(need, sender(need), r)), []).append(("recv", need))
        posted.add(need)

    def post_ahead(r):
        for flow in reads[r].values():
            head = next((m for m in flow if m not in read), None)
            if head is not None and head not in posted and (head[0] == "act" or ("F",) + head[1:] in forwards):
                post(r, head)

    while True:
        moved = False
        for r in range(p):
            while pc[r] < len(programs[r]):
                if ahead:
                    post_ahead(r)
                need, sends = programs[r][pc[r]]
                if need is not None and need not in posted:
                    post(r, need)
                if need is not None and need not in done:
                    break
                read.add(need)
                for m in sends:
                    queues.setdefault((r, group_of(m, r, receiver(m))), []).append(("send", m))
                    if m[0] == "act":  # this rank ran the forward of (vstage, micro): its gradient is knowable
                        forwards.add(("F", m[1] - 1, m[2]))
                pc[r] += 1
                moved = True
        for (r, g), q in queues.items():
            if q and q[0][0] == "send":
                peer = queues.get((receiver(q[0][1]), g), [])
                if peer and peer[0] == ("recv", q[0][1]):
                    done.add(q.pop(0)[1])
                    peer.pop(0)
                    moved = True
        if not moved:
            return not (all(pc[r] == len(programs[r]) for r in range(p)) and not any(queues.values()))


@pytest.mark.parametrize("ahead", [True, False])
@pytest.mark.parametrize("name,p,m,v", [c for c in CASES if c[1] > 1])
def test_point_to_point_flows_never_wait_on_each_other_under_nccl_rules(name, p, m, v, ahead):
    # zerotron's pipe/p2p.py: one group per flow (activations s -> s+1, gradients s+1 -> s, and the
    # wrap-around ones of interleaved schedules), receives posted ahead or not
    assert not _stalls(build_schedule(name, p, m, v), p, v, lambda msg, src, dst: (msg[0], src, dst), ahead)


def test_one_group_for_every_flow_would_deadlock():
    # what batching activations and gradients on one NCCL group does to plain 1F1B (and worse
    # to interleaved schedules): each stage's next operation is a send the other cannot match yet
    assert _stalls(build_schedule("1f1b", 2, 2, 1), 2, 1, lambda msg, src, dst: "pp")
    assert _stalls(build_schedule("interleaved", 2, 4, 2), 2, 2, lambda msg, src, dst: msg[0])


# ---- receives posted ahead (zerotron/pipe/p2p.py's Inbox) -------------------------------------------
class _Recorder:
    """A stand-in for P2P that logs each receive's posting, by flow."""

    def __init__(self, log):
        self.log = log

    def post_activation(self, src, vstage, first):
        self.log.append(("post", ("act", src)))
        return self

    def post_gradient(self, like, src):
        self.log.append(("post", ("grad", src)))
        return self

    def wait(self):
        return ()


@pytest.mark.parametrize("name,p,m,v", [c for c in CASES if c[1] > 1])
def test_each_receive_is_posted_as_soon_as_the_schedule_makes_it_knowable(name, p, m, v):
    """A receive is posted before the computation that follows the read of the previous message of
    its flow (a gradient's, also of the forward it answers): the message can then arrive while the
    stage computes; and no flow has two receives outstanding."""
    from zerotron.pipe.p2p import Inbox
    from zerotron.pipe.schedule import location, virtual_stage

    last = p * v - 1
    for s, actions in enumerate(build_schedule(name, p, m, v)):
        reads, answers = [], []  # per action: what it receives (as the engine's _reads), the forward it answers
        for a in actions:
            vs = virtual_stage(s, a.chunk, p)
            if a.kind == "F" and vs > 0:
                reads.append(("act", location(vs - 1, p)[0], vs, a.micro == 0))
            elif a.kind == "B" and vs < last:
                reads.append(("grad", location(vs + 1, p)[0], (a.chunk, a.micro)))
            else:
                reads.append(None)
            answers.append(actions.index(Action("F", a.chunk, a.micro)) if a.kind == "B" else None)
        log, forwarded = [], set()
        inbox = Inbox(_Recorder(log), reads, lambda key: [] if key in forwarded else None)
        for i, (a, r) in enumerate(zip(actions, reads)):
            if r is not None:
                log.append(("read", i))
                inbox.take(i)
            log.append(("compute", i))
            if a.kind == "F":
                forwarded.add((a.chunk, a.micro))
                inbox.post_ready()
        inbox.finish()
        at = {event: t for t, event in enumerate(log) if event[0] != "post"}
        posts, flows = {}, {}
        for t, event in enumerate(log):
            if event[0] == "post":
                posts.setdefault(event[1], []).append(t)
        for i, r in enumerate(reads):
            if r is not None:
                flows.setdefault(r[:2], []).append(i)
        for flow, indices in flows.items():
            assert len(posts[flow]) == len(indices)  # the k-th receive posted on a flow is its k-th read's
            for k, i in enumerate(indices):
                ready = at[("read", indices[k - 1])] if k else 0
                if reads[i][0] == "grad":
                    ready = max(ready, at[("compute", answers[i])])
                next_compute = min(t for e, t in at.items() if e[0] == "compute" and t > ready)
                assert posts[flow][k] < next_compute, (s, i, flow)
                assert k == 0 or posts[flow][k] > at[("read", indices[k - 1])]  # one outstanding per flow
