"""The planner for layouts that split each sequence (Ulysses x ring, planner/sequence.py): the bytes against
hand-computed figures, the engine tests' arithmetic and what the engine sends; activation memory against what
a split forward keeps; compute, ZeRO and gradient reduction over every sequence rank; the time of the
exchanges and of the ring's overlap; and the search and `zerotron plan` at a sequence that fits no other way."""

import json

import pytest
import torch
import torch.distributed as dist
from distributed import run_ranks
from parity import ds_config

import zerotron
from zerotron.planner import ModelShape
from zerotron.planner.cost import Layout, memory, step_time
from zerotron.planner.hardware import hardware
from zerotron.planner.sequence import recomputed_share, ring_bytes, ulysses_bytes

L3_8B = ModelShape.parse("llama3-8b")  # 32 query heads, 8 key/value heads of 128


# ---- bytes ---------------------------------------------------------------------------------------------
def test_bytes_against_hand_computed_figures():
    """Llama 3 8B, one sequence of 131,072 tokens over u 4 x c 2 ranks (16,384 tokens each), bf16."""
    # Ulysses: 3/4 of q, k, v and the output, 16,384 tokens x 128 x (32 + 8 + 8 + 32) heads x 2 bytes
    assert ulysses_bytes(L3_8B, 1, 131072, 4, 2, a=2) == 251_658_240
    # the ring: k and v blocks of 16,384 tokens x 8 heads x 128 (67,108,864 bytes in bf16, twice that in
    # fp32 for their gradients); forward passes them once (c - 1), backward once and the gradients twice (c)
    r = ring_bytes(L3_8B, 1, 131072, 2, 4, a=2)
    assert (r["kv"], r["dkv"]) == (67_108_864, 134_217_728)
    assert (r["forward"], r["backward"]) == (67_108_864, 67_108_864 + 2 * 134_217_728)
    # tensor parallelism splits the heads first (a hook for when the engine takes both)
    assert ulysses_bytes(L3_8B, 1, 131072, 4, 2, tp=2, a=2) == 251_658_240 / 2
    assert ulysses_bytes(L3_8B, 1, 131072, 1, 8) == 0 and ring_bytes(L3_8B, 1, 131072, 1, 8)["backward"] == 0


def test_bytes_against_the_engine_tests_arithmetic():
    """The counts tests/test_ulysses.py and tests/test_ring.py assert of the engine, in their own terms."""
    seq, heads, kv_heads, head = 16, 4, 2, 8  # test_ulysses: DistributedAttention, batch 2, fp32
    shape = ModelShape(1, heads * head, heads, kv_heads, 64, 64)
    for world in (2, 4):
        elements = 2 * (seq // world) * 8 * (heads + kv_heads + kv_heads + heads) * (world - 1) // world
        assert 2 * ulysses_bytes(shape, 2, seq, world, a=4) == 2 * elements * 4  # forward and backward
    seq = 32  # test_ring: 4 query heads of 8, batch 2, fp32
    for world, kv_heads in ((2, 2), (4, 1), (2, 4)):
        block = 2 * kv_heads * (seq // world) * head * 4
        r = ring_bytes(ModelShape(1, heads * head, heads, kv_heads, 64, 64), 2, seq, world, a=4)
        assert r["forward"] + r["backward"] == 2 * block * ((world - 1) + (world - 1) + world)


def _saved_bytes(model, tokens, targets, forward) -> tuple[int, torch.Tensor]:
    """Bytes of the distinct non-parameter tensors autograd keeps from one forward."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = forward(tokens, targets)
    return sum(seen.values()), loss


def _split_gpt(sp, cp, bf16, policy, kv_heads):
    from zerotron.long_context.layout import SequenceSplit
    from zerotron.models.gpt import GPT, config_for

    torch.manual_seed(0)
    config = ds_config(
        2,
        1,
        sequence_parallel_size=sp,
        bf16={"enabled": bf16},
        zerotron={"context_parallel_size": cp, "checkpoint_policy": policy},
    )
    model = GPT(config_for("small", n_layer=3, max_seq_len=64, n_kv_head=kv_heads))
    engine, *_ = zerotron.initialize(model=model, config=config)
    split = SequenceSplit.of(engine.topology, dist.get_rank())
    g = torch.Generator().manual_seed(0)
    tokens, targets = (split.take(torch.randint(0, 256, (2, 64), generator=g)) for _ in range(2))
    engine.reset_comm_stats()
    saved, loss = _saved_bytes(engine.module, tokens, targets, engine)
    forward = engine.comm_stats()
    engine.backward(loss)
    return saved, forward, engine.comm_stats()


@pytest.mark.parametrize(
    "world,sp,cp,bf16,policy,kv_heads",
    [
        (2, 2, 1, True, "none", 2),
        (2, 1, 2, True, "none", 4),  # the ring keeps k, v unrepeated and its output in fp32: 12d against 5·a·d
        (4, 2, 2, False, "none", 2),
        (2, 1, 2, False, "every_block", 2),
        (2, 1, 2, True, "every_k", 2),  # 2 of the 3 blocks checkpointed: their passes again
        (2, 2, 1, True, "selective", 2),  # the attention core recomputed: its all-to-alls again
    ],
)
def test_what_the_engine_sends_and_keeps_under_a_split_sequence(world, sp, cp, bf16, policy, kv_heads):
    from zerotron.models.gpt import config_for

    shape = ModelShape.of_gpt(config_for("small", n_layer=3, n_kv_head=kv_heads))
    a, again = (2 if bf16 else 4), recomputed_share(shape, policy)
    ulysses = shape.layers * ulysses_bytes(shape, 2, 64, sp, cp, a=a)
    ring = {k: shape.layers * v for k, v in ring_bytes(shape, 2, 64, cp, sp, a=a).items()}
    layout = Layout(dp=world // (sp * cp), ulysses=sp, ring=cp, micro_batch=2, checkpoint=policy)
    kept = memory(shape, layout, 64, "bf16" if bf16 else "fp32")["activations"]
    for saved, forward, total in run_ranks(_split_gpt, world, sp, cp, bf16, policy, kv_heads):
        assert (forward["all_to_all"], forward["p2p"]) == (ulysses, ring["forward"])
        assert total["all_to_all"] == ulysses * (2 + again)  # backward, and each recomputed forward
        assert total["p2p"] == ring["forward"] * (1 + again) + ring["backward"]
        if policy != "selective":  # (selective's cache is not autograd's saved tensors: test_planner_memory.py)
            assert kept == pytest.approx(saved, rel=0.02)


# ---- memory, compute and data parallelism --------------------------------------------------------------
def test_a_layout_counts_its_sequence_ranks():
    L = Layout(dp=2, ulysses=2, ring=2, zero=3)
    assert (L.gpus, L.replicas, L.sequence_ranks) == (8, 8, 4)
    assert L.describe() == "dp2 tp1 pp1 u2 cp2 zero3 mb1x1"
    assert "u1" not in Layout(dp=8).describe() and "cp1" not in Layout(dp=8).describe()


def test_memory_shards_over_every_rank_and_keeps_each_ranks_tokens():
    from zerotron.planner.activations import activation_bytes

    seq = 131072
    whole = memory(L3_8B, Layout(dp=8, zero=3, checkpoint="every_block"), seq)
    for u, c in ((8, 1), (1, 8), (2, 4)):
        split = memory(L3_8B, Layout(dp=1, ulysses=u, ring=c, zero=3, checkpoint="every_block"), seq)
        for part in ("params", "grads", "master_weights", "optimizer"):  # ZeRO-3 over the 8 ranks alike
            assert split[part] == whole[part], (u, c, part)
        kept = activation_bytes(L3_8B, 1, seq // 8, "every_block", dtype="bf16", ring=c > 1)
        assert split["activations"] == kept < whole["activations"] / 7.9


def test_compute_and_gradient_reduction_span_the_sequence_ranks():
    hw = hardware("h100")
    seq, base = 131072, Layout(dp=8, zero=1, micro_batch=1, grad_accum=1)
    # each rank computes 1/8 of the sequence for 8 micro-batches: what a data rank computes for one
    compute = step_time(L3_8B, Layout(dp=1, ulysses=4, ring=2, micro_batch=1, grad_accum=8), seq, hw)["compute"]
    assert compute == pytest.approx(step_time(L3_8B, base, seq, hw)["compute"])
    # with nothing hidden (overlap 0) the data-parallel time is the collectives themselves: over the
    # same 8 ranks as dp 8's, at every ZeRO stage
    exposed = hw.with_overrides(overlap=0.0)
    for zero in (0, 1, 2, 3):
        want = step_time(L3_8B, Layout(dp=8, zero=zero), seq, exposed)["data_parallel"]
        for dp, u, c in ((1, 8, 1), (2, 1, 4), (2, 2, 2)):
            got = step_time(L3_8B, Layout(dp=dp, ulysses=u, ring=c, zero=zero), seq, exposed)["data_parallel"]
            assert got == pytest.approx(want), (zero, dp, u, c)


# ---- the time of the exchanges -------------------------------------------------------------------------
def test_ulysses_exchanges_are_exposed_in_forward_backward_and_recomputation():
    hw = hardware("h100")
    L = Layout(dp=1, ulysses=8, micro_batch=1, grad_accum=2, checkpoint="every_block")
    one_way = 293_601_280 / (hw.intra_gbps * 1e9) + 4 * hw.intra_latency_us * 1e-6  # 7/8 · 16,384 · 128 · 80 · 2
    assert ulysses_bytes(L3_8B, 1, 131072, 8) == 293_601_280
    t = step_time(L3_8B, L, 131072, hw)
    assert t["ulysses_all_to_all"] == pytest.approx(2 * L3_8B.layers * 3 * one_way)  # 2 micro-batches
    assert t["ring_p2p"] == 0 and step_time(L3_8B, Layout(dp=8), 131072, hw)["ulysses_all_to_all"] == 0


def test_the_ring_hides_its_passes_under_the_block_being_computed():
    seq, c, fast = 131072, 4, hardware("h100")
    L = Layout(dp=1, ring=c, micro_batch=1, grad_accum=1)
    width = L3_8B.hidden
    rate = fast.peak_flops * fast.efficiency * width / (width + fast.knee)
    step = seq / c * 4 * seq * width / rate / c  # one block of the rank's attention, forward
    r = ring_bytes(L3_8B, 1, seq, c)
    for hw in (fast, fast.with_overrides(intra_gbps=1)):
        kv, dkv = (r[k] / (hw.intra_gbps * 1e9) + hw.intra_latency_us * 1e-6 for k in ("kv", "dkv"))
        if kv < step:  # NVLink: forward's passes hidden; backward waits for each block's gradients
            forward, backward = 0.0, c * dkv
        else:  # 1 GB/s: each pass outlasts its block; backward's link runs kv, dkv one after another
            forward = (c - 1) * (kv - step)
            backward = (c - 1) * (kv + dkv) + 2 * step + dkv - 2 * c * step
        got = step_time(L3_8B, L, seq, hw)["ring_p2p"]
        assert got == pytest.approx(L3_8B.layers * (forward + backward)), hw.intra_gbps
    # hardware that hides nothing beside compute (overlap 0) pays every pass
    none = fast.with_overrides(overlap=0.0)
    kv, dkv = (r[k] / (none.intra_gbps * 1e9) + none.intra_latency_us * 1e-6 for k in ("kv", "dkv"))
    got = step_time(L3_8B, L, seq, none)["ring_p2p"]
    assert got == pytest.approx(L3_8B.layers * (2 * (c - 1) * kv + c * dkv))


# ---- the search and the command ------------------------------------------------------------------------
def test_the_search_splits_sequences_only_where_the_engine_does():
    from zerotron.planner.search import sequence_splits

    assert set(sequence_splits(L3_8B, 8, 8, 131072, 1, 1)) == {
        (2, 1), (4, 1), (8, 1), (1, 2), (2, 2), (4, 2), (1, 4), (2, 4), (1, 8)
    }  # fmt: skip
    assert sequence_splits(L3_8B, 16, 8, 131072, 2, 1) == sequence_splits(L3_8B, 16, 8, 131072, 1, 2) == []
    gqa2 = ModelShape(4, 512, 8, 2, 1024, 1000)  # Ulysses at most 2 (the key/value heads); the ring any
    assert {u for u, _ in sequence_splits(gqa2, 16, 8, 4096, 1, 1)} == {1, 2}
    assert (1, 16) in sequence_splits(gqa2, 16, 8, 4096, 1, 1)
    assert (1, 4) not in sequence_splits(gqa2, 16, 8, 4 * 7, 1, 1)  # 28 tokens are not 2 x 4 chunks


def test_a_sequence_that_fits_no_other_way_is_split():
    """A Qwen2.5-7B-like shape (28 query, 4 key/value heads) at 262,144 tokens on 8 H100s: no layout without a
    split fits, and Ulysses alone stops at 4 ranks (the key/value heads); the ring goes further."""
    from zerotron.config import Config
    from zerotron.planner.search import deepspeed_config, plan

    shape, hw = ModelShape(28, 3584, 28, 4, 18944, 152064), hardware("h100")
    assert all(c.rejected for c in plan(shape, 8, hw, 262144, 8, sequence_splits="never"))
    candidates = plan(shape, 8, hw, 262144, 8)
    fitting = [c for c in candidates if c.rejected is None]
    assert fitting and all(c.layout.sequence_ranks > 1 for c in fitting)
    for c in candidates:
        L = c.layout
        assert L.gpus == 8 and L.dp * L.micro_batch * L.grad_accum == 8
        if L.sequence_ranks > 1:  # what the engine runs today: no tensor or pipeline parallelism beside it
            assert L.tp == L.pp == 1 and shape.heads % L.ulysses == shape.kv_heads % L.ulysses == 0
    for c in fitting[:10]:  # the configs it writes are ones the engine accepts
        cfg = Config.load(deepspeed_config(c.layout, 8), world_size=8)
        assert (cfg.dp_size, cfg.train_batch_size) == (c.layout.dp, 8)
        assert (cfg.sequence_parallel_size, cfg.zerotron.context_parallel_size) == (c.layout.ulysses, c.layout.ring)


def test_a_split_is_weighed_where_every_other_layout_recomputes():
    """Llama 3 8B at 131,072 tokens on 8 H100s: without a split only tensor parallelism with full
    recomputation fits; a split is added, and it is faster."""
    from zerotron.planner.search import plan

    hw = hardware("h100")
    never = [c for c in plan(L3_8B, 8, hw, 131072, 8, sequence_splits="never") if c.rejected is None]
    assert never and all(c.layout.checkpoint != "none" or c.layout.offload != "none" for c in never)
    best = next(c for c in plan(L3_8B, 8, hw, 131072, 8) if c.rejected is None)
    assert best.layout.sequence_ranks > 1 and best.tokens_per_s > 1.1 * never[0].tokens_per_s


def test_short_sequences_are_planned_as_before():
    """The docs' example: layouts that fit without recomputation or offload, so no split is added."""
    from zerotron.planner.search import plan

    hw = hardware("h100")
    auto, never = (plan(L3_8B, 64, hw, 8192, 512, sequence_splits=s) for s in ("auto", "never"))
    assert [(c.layout, c.tokens_per_s) for c in auto] == [(c.layout, c.tokens_per_s) for c in never]
    always = plan(L3_8B, 8, hw, 8192, 64, sequence_splits="always")
    assert any(c.layout.ulysses > 1 for c in always) and any(c.layout.ring > 1 for c in always)
    with pytest.raises(ValueError, match="sequence_splits is one of"):
        plan(L3_8B, 8, hw, 8192, 64, sequence_splits="sometimes")


def test_plan_command_proposes_a_split_sequence(tmp_path):
    import subprocess
    import sys

    out = tmp_path / "plan.json"
    argv = "plan --model llama3-8b --gpus 8 --hardware h100 --seq 131072 --global-batch 8 --out".split()
    run = subprocess.run(
        [sys.executable, "-m", "zerotron.cli", *argv, str(out)], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    best = next(line for line in run.stdout.splitlines() if line.strip().startswith("1 "))
    config = json.loads(out.read_text())
    u, c = config.get("sequence_parallel_size", 1), config["zerotron"].get("context_parallel_size", 1)
    assert u * c > 1 and (f"u{u}" in best.split()) == (u > 1) and (f"cp{c}" in best.split()) == (c > 1)
    assert "shard_batch" in run.stdout  # how a script feeds each rank its part of every sequence


def test_a_split_plan_trains(tmp_path):
    """The config of the best split layout for the tiny GPT on 2 ranks runs under `zerotron train`."""
    import subprocess
    import sys

    from zerotron.models.gpt import config_for
    from zerotron.planner.search import deepspeed_config, plan

    shape = ModelShape.of_gpt(config_for("tiny"))
    candidates = plan(shape, 2, hardware("cpu"), 64, 4, "fp32", sequence_splits="always")
    best = next(c for c in candidates if c.rejected is None and c.layout.sequence_ranks > 1)
    out = tmp_path / "split.json"
    out.write_text(json.dumps(deepspeed_config(best.layout, 4, "fp32")))
    argv = "train --model tiny --seq-len 64 --steps 2 --eval-batches 1 --sample-bytes 0 --corpus-bytes 20000".split()
    run = subprocess.run(
        [sys.executable, "-m", "zerotron.cli", *argv, "--config", str(out), "--nproc", "2"],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "model states: predicted" in run.stderr
    for name, size in (("cp", best.layout.ring), ("sp", best.layout.ulysses)):  # the engine's own topology line
        assert (f" x {name} {size} " in run.stdout + run.stderr) == (size > 1), (name, size)
