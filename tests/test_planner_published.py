"""The planner against published training runs (tests/planner_published/): the comparison stays
within the bounds docs/planner.md states, and each term the published engines need does what its
docstring says. No GPU and no processes: the comparison is arithmetic."""

import pytest
from planner_published import comparison as published

from zerotron.planner import ModelShape
from zerotron.planner.cost import Layout, _group_link, _ring, score_traffic_s, step_time
from zerotron.planner.hardware import hardware
from zerotron.planner.reuse import gathered

# docs/planner.md explains each of these; any other run beyond 25% is a regression.
EXPLAINED = {
    "torchtitan H100 Llama 3.1 8B FSDP 8",
    "torchtitan H100 Llama 3.1 8B FSDP 128",
    "torchtitan H100 Llama 3.1 8B FSDP+TP8, async TP",
    "Llama 3 405B stage 1",
    "Llama 3 405B stage 2",
    "GPT 530B ZeRO-3 640",
}


@pytest.fixture(scope="module")
def rows():
    return published.comparison()


def test_published_runs_stay_within_the_documented_bounds(rows):
    s = published.summarize(rows)
    assert s["runs"] == 62
    assert s["median_abs_pct_error"] <= 9.5  # docs/planner.md: 7.5% (the goal: 10%)
    assert s["mean_abs_pct_error"] <= 12.0  # 10.3%
    assert all(0.6 <= r["ratio"] <= 1.45 for r in rows), [(r["name"], r["ratio"]) for r in rows]  # 0.66-1.34
    assert set(s["beyond_25_pct"]) <= EXPLAINED, set(s["beyond_25_pct"]) - EXPLAINED
    assert s["per_set"]["first 29"]["median_abs_pct"] <= 7.2  # the first comparison's median, before this work
    # pooled_nics=False is fitted to Narayanan's six DeepSpeed ZeRO-3 rows: the bound that tests the
    # planner leaves them out
    assert s["fitted"]["runs"] == 6 and s["not_fitted"]["runs"] == 56
    assert s["not_fitted"]["median_abs_pct"] <= 9.0  # 8.1%


def test_megatron_core_shapes_count_the_flops_megatron_counts(rows):
    """The table's MFU column (Megatron-Core's own FLOP count over 989 TFLOP/s) against the planner's
    6N + 12·L·d·s over the same peak: equal within 1.5 points when the shape (untied embeddings,
    4h MLP, 131,072 vocabulary) is the one the source ran."""
    table_mfu = [41, 47, 49, 46, 42, 43, 44, 48, 47]
    core = [r for r in rows if r["family"] == "Megatron-Core 2024 (H100)"]
    assert len(core) == len(table_mfu)
    for r, mfu in zip(core, table_mfu):
        assert 100 * r["published_mfu"] == pytest.approx(mfu, abs=1.5), r["name"]


def _gpt3_like():
    return ModelShape(24, 2048, 16, 16, 4 * 2048, 50_304, tied=True, gated=False)


def test_materialized_attention_scores_cost_their_trips_through_device_memory():
    shape, hw, seq = _gpt3_like(), hardware("a100-80"), 2048
    for checkpoint, per_score in (("none", 13 + 19), ("every_block", 13 + 19 + 13), ("selective", 13 + 19 + 13)):
        flash = Layout(dp=8, zero=1, micro_batch=2, grad_accum=4, checkpoint=checkpoint)
        scores = Layout(dp=8, zero=1, micro_batch=2, grad_accum=4, checkpoint=checkpoint, flash_attention=False)
        assert step_time(shape, flash, seq, hw)["attention_scores"] == 0
        # per micro-batch: tokens x layers x heads x s scores, per_score bytes each, at the HBM bandwidth
        expected = 2 * seq * shape.layers * shape.heads * seq * per_score / (hw.hbm_gbps * 1e9)
        assert step_time(shape, scores, seq, hw)["attention_scores"] == pytest.approx(4 * expected)
    # split like the heads across tensor and pipeline parallelism
    split = Layout(dp=2, tp=2, pp=2, zero=1, micro_batch=2, grad_accum=4, flash_attention=False)
    assert score_traffic_s(shape, split, seq, hw, 0.0) == pytest.approx(
        2 * seq * shape.layers * shape.heads * seq * 32 / (hw.hbm_gbps * 1e9) / 4
    )


def test_overlapped_tensor_parallelism_shows_only_what_the_gemms_cannot_hide():
    shape, seq = _gpt3_like(), 2048
    hw = hardware("a100-80")
    plain = step_time(shape, Layout(dp=1, tp=8, zero=1, micro_batch=2, grad_accum=4), seq, hw)
    hidden = step_time(shape, Layout(dp=1, tp=8, zero=1, micro_batch=2, grad_accum=4, tp_overlap=True), seq, hw)
    assert plain["tensor_parallel"] > 0 and hidden["tensor_parallel"] == 0
    slow = hw.with_overrides(intra_gbps=1)  # collectives far longer than the GEMMs: the excess stays
    plain = step_time(shape, Layout(dp=1, tp=8, zero=1, micro_batch=2, grad_accum=4), seq, slow)
    hidden = step_time(shape, Layout(dp=1, tp=8, zero=1, micro_batch=2, grad_accum=4, tp_overlap=True), seq, slow)
    assert hidden["tensor_parallel"] == pytest.approx(plain["tensor_parallel"] - plain["compute"])


def test_deepspeed_releases_per_sub_module_within_the_reuse_distance():
    """reuse.py against DeepSpeed's rule (a sub-module's parameters stay gathered if it runs again
    within stage3_max_reuse_distance elements of the sub-modules between), on GPT-3 175B's linears."""
    shape = ModelShape(96, 12288, 96, 96, 4 * 12288, 51_200, tied=True, gated=False)
    h2 = 12288**2
    linears = shape.linears(fused_qkv=True)
    assert linears == (3 * h2, h2, 4 * h2, 4 * h2)  # query_key_value, dense, dense_h_to_4h, dense_4h_to_h
    block, root, every = sum(linears), 51_200 * 12288, (True,) * 96
    # after a block's recomputed forward its linears come back after 18h², 16h², 8h² and 0 elements:
    # with 1e9 the first three are gathered again for the backward
    forward, backward = gathered(linears, 96, every, 1e9, root)
    assert forward[0] == block and backward[0] == block + 8 * h2
    # with 3e9 (the Azure recipes) 18h² = 2.7e9 is within: the backward reuses the recomputed forward's,
    # and the last block (9h² and the root between its forward and its recomputation) is never released
    forward, backward = gathered(linears, 96, every, 3e9, root)
    assert backward[0] == block and backward[-1] == 0
    # without recomputation a block's backward comes after every later block's: gathered again
    assert gathered(linears, 96, (False,) * 96, 3e9, root)[1][0] == block


def test_deepspeed_zero3_regathers_what_it_released_over_one_nic_per_gpu():
    shape, seq = _gpt3_like(), 2048
    # compute and latency made free, so the step shows the ZeRO-3 traffic's bandwidth term itself
    hw = hardware("a100-80").with_overrides(peak_tflops=1e12, inter_latency_us=0, intra_latency_us=0)
    base = dict(dp=32, zero=3, micro_batch=1, grad_accum=1, checkpoint="every_block", zero3_regather=True)
    release, keep, one_nic = (
        step_time(shape, Layout(**base, **extra), seq, hw)["data_parallel"]
        for extra in (
            {"stage3_max_reuse_distance": 0},
            {"stage3_max_reuse_distance": 1e15},
            {"stage3_max_reuse_distance": 0, "pooled_nics": False},
        )
    )
    # released after every use, each block is gathered for its recomputed forward (12d²) and then its
    # backward (all but the last linear, reused at once: 8d²); kept, neither
    d2 = shape.hidden**2
    bw, lat = _group_link(hw, 32, hw.gpus_per_node)
    assert bw == pytest.approx(hw.inter_gbps * hw.gpus_per_node)  # a group with 8 GPUs per node: 8 NICs
    assert release - keep == pytest.approx(_ring(2 * 20 * d2 * shape.layers, 32, bw, lat, 1), rel=1e-3)
    # each GPU's traffic through its own NIC: 8x as long
    assert one_nic / release == pytest.approx(hw.gpus_per_node, rel=1e-3)


def test_torchtitans_op_level_checkpointing_recomputes_every_second_matmul():
    """op_sac: torchtitan's policy ("Saves output of all compute ops, except every second mm") runs
    k, o and the MLP's up projection of a Llama block again: 11% more FLOPs for Llama 2 13B at 4096."""
    shape, seq, hw = ModelShape(40, 5120, 40, 40, 13824, 32000), 4096, hardware("a100-80")
    plain, op = (
        step_time(shape, Layout(dp=64, zero=3, micro_batch=2, checkpoint=c), seq, hw)["compute"]
        for c in ("none", "op_sac")
    )
    d, f = shape.hidden, shape.ffn
    extra = 2 * shape.layers * (d * d + d * d + d * f)  # k, o, up
    assert op / plain == pytest.approx(1 + extra / shape.flops_per_token(seq))
    assert op / plain == pytest.approx(1.113, abs=0.002)
    # its memory: the block input, q, v, gate and down outputs, the attention's output and log-sum-exp
    from zerotron.planner.activations import activation_bytes

    kept = activation_bytes(shape, 1, seq, "op_sac", dtype="bf16", layers=1, first_stage=False, last_stage=False)
    rotary = 4 * seq * (d // shape.heads)
    assert kept - rotary == seq * (2 * (d + d + d + f + d + d) + 4 * shape.heads)


def test_zerotrons_own_layouts_are_costed_as_before():
    """The engine-property fields default to zerotron's engine: none of them is on in a plain Layout."""
    L = Layout(dp=8)
    assert (L.tp_overlap, L.flash_attention, L.zero3_regather, L.pooled_nics) == (False, True, False, True)
    assert "tp-overlap" not in L.describe() and "nic-per-gpu" not in L.describe()


def test_offloaded_gradients_are_never_negative_on_the_device():
    """Offload keeps the fp32 gradient buffer on the host only in fp32 (memory.py); the device side must
    not take it off in bf16, where it was never counted."""
    from zerotron.planner.cost import memory

    shape = ModelShape(32, 4096, 32, 32, 11008, 32000)
    for dtype in ("bf16", "fp32"):
        plain = memory(shape, Layout(dp=8, zero=2), 4096, dtype)
        off = memory(shape, Layout(dp=8, zero=2, offload="optimizer"), 4096, dtype)
        assert off["grads"] == plain["grads"] > 0, dtype


def test_context_parallel_runs_stay_where_docs_planner_md_puts_them():
    """tests/planner_published/long_context.py, compared apart from the 62 runs above."""
    from planner_published import long_context

    rows = {r["name"]: r for r in long_context.comparison()}
    titan = [r["ratio"] for name, r in rows.items() if name.startswith("torchtitan")]
    assert len(titan) == 4
    assert all(0.9 <= r <= 1.05 for r in titan[:2]), titan  # 32,768 tokens (no CP) and CP 2: 0.96, 0.96
    assert all(1.25 <= r <= 1.5 for r in titan[2:]), titan  # CP 4 and 8: 1.33 and 1.43, not explained
    llama = rows["Llama 3 405B long context (CP 16)"]
    assert 0.65 <= llama["ratio"] <= 0.85 and llama["fits"]  # 0.74 (the stage rows' pipeline); no checkpointing
    assert llama["time"]["ring_p2p"] > 0 and all(r["time"]["ulysses_all_to_all"] == 0 for r in rows.values())
