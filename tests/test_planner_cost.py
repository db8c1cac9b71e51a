"""The planner's model shapes (names, specs, Transformers configs) and its cost model: micro-batches in
flight, step-time terms, the memory breakdown, and what the engine overlaps (planner/overlap.py)."""

import pytest
from parity import make_model

from zerotron.planner import ModelShape


# ---- model shapes -------------------------------------------------------------------------------------
def test_model_shapes_from_names_specs_and_hf_configs(tmp_path):
    import json

    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    shape = ModelShape.parse(str(tmp_path))  # a directory holding config.json
    assert (shape.layers, shape.hidden, shape.heads, shape.kv_heads, shape.ffn, shape.vocab) == (3, 64, 4, 2, 160, 320)
    assert shape.parameters == AutoModelForCausalLM.from_config(cfg).num_parameters()
    assert ModelShape.parse("llama3-8b").parameters == pytest.approx(8.03e9, rel=0.001)
    spec = ModelShape.parse("layers=2,hidden=64,heads=4,vocab=256,kv_heads=2")
    assert spec == ModelShape.of_gpt(__import__("zerotron.models.gpt", fromlist=["config_for"]).config_for("tiny"))
    for bad, message in (
        ("nonsense", "unknown model"),
        ("layers=2,hidden=64", "needs heads"),
        ("layers=2,hidden=64,heads=4,vocab=8,width=3", "unknown model dimension"),
        (str(tmp_path / "missing.json"), "no model config"),
    ):
        with pytest.raises((ValueError, FileNotFoundError), match=message):
            ModelShape.parse(bad)


# ---- the cost model ------------------------------------------------------------------------------------
def _cost():
    from zerotron.planner import cost, hardware

    return cost, hardware


def test_pipeline_micro_batches_in_flight_follow_the_schedule():
    cost, _ = _cost()
    assert cost.in_flight("1f1b", 4, 8, 1) == (4, 3, 2, 1)
    assert cost.in_flight("gpipe", 4, 8, 1) == (8, 8, 8, 8)
    assert cost.in_flight("1f1b", 4, 2, 1)[0] == 2  # never more than there are micro-batches
    assert cost.in_flight("zb-h1", 4, 8, 1) == (4, 4, 4, 4)  # activations live until W: 1F1B's first stage's


def test_step_time_terms():
    cost, hardware = _cost()
    shape = ModelShape.parse("1.3b")
    hw = hardware.hardware("a100-80")
    free = hw.with_overrides(intra_gbps=1e9, inter_gbps=1e9, intra_latency_us=0, inter_latency_us=0, hbm_gbps=1e9)
    base = cost.Layout(dp=8, zero=1, micro_batch=2, grad_accum=4)
    t = cost.step_time(shape, base, 2048, free)
    # compute: 6N + 12·L·d·s per token at the calibrated rate, nothing else when links are free
    rate = hw.peak_flops * hw.efficiency * shape.hidden / (shape.hidden + hw.knee)
    assert t["compute"] == pytest.approx(2 * 4 * 2048 * shape.flops_per_token(2048) / rate)
    assert t["total"] == pytest.approx(t["compute"], rel=1e-3)
    # full recomputation adds a forward of the blocks: about a third more compute
    ckpt = cost.step_time(
        shape, cost.Layout(dp=8, zero=1, micro_batch=2, grad_accum=4, checkpoint="every_block"), 2048, free
    )
    assert 1.28 < ckpt["compute"] / t["compute"] < 1.34
    # the bubble of p stages over m micro-batches is (p - 1) / m of the busy time, / v interleaved
    for schedule, chunks in (("1f1b", 1), ("interleaved", 2)):
        pp = cost.step_time(
            shape,
            cost.Layout(dp=2, pp=4, zero=1, micro_batch=2, grad_accum=16, schedule=schedule, chunks=chunks),
            2048,
            free,
        )
        assert pp["bubble"] / pp["compute"] == pytest.approx(3 / 16 / chunks)
    # ZeRO-3 moves 1.5x the bytes of ZeRO-1; on slow links it shows, and tokens/s falls
    slow = hw.with_overrides(intra_gbps=5, inter_gbps=5)
    z1, z3 = (cost.step_time(shape, cost.Layout(dp=8, zero=z, micro_batch=2, grad_accum=1), 2048, slow) for z in (1, 3))
    assert z3["data_parallel"] > z1["data_parallel"] > 0
    # tensor parallelism: per-layer all-reduces that nothing hides
    tp = cost.step_time(shape, cost.Layout(dp=4, tp=2, zero=1, micro_batch=2, grad_accum=4), 2048, hw)
    assert tp["tensor_parallel"] > 0 and cost.step_time(shape, base, 2048, hw)["tensor_parallel"] == 0
    mfu = cost.throughput(shape, base, 2048, hw)["mfu"]
    assert 0 < mfu < hw.efficiency


def test_memory_breakdown_adds_up_and_offload_moves_states_to_the_host():
    cost, _ = _cost()
    shape = ModelShape.parse("llama2-7b")
    plain = cost.memory(shape, cost.Layout(dp=8, zero=3, micro_batch=1), 4096)
    assert plain["total"] == sum(
        plain[k] for k in ("params", "grads", "master_weights", "optimizer", "activations", "buffers")
    )
    off = cost.memory(shape, cost.Layout(dp=8, zero=3, micro_batch=1, offload="optimizer+param"), 4096)
    assert off["optimizer"] == off["master_weights"] == 0 and off["host"] > 12 * shape.parameters / 8
    assert off["total"] < plain["total"] - 12 * shape.parameters / 8 * 0.99
    ckpt = cost.memory(shape, cost.Layout(dp=8, zero=3, micro_batch=1, checkpoint="every_block"), 4096)
    assert ckpt["activations"] < 0.1 * plain["activations"]


# ---- what the engine overlaps (planner/overlap.py) ----------------------------------------------------
def test_timeline_plays_the_engines_issue_order():
    from zerotron.planner.overlap import timeline

    # reductions issued as each segment ends: the link runs one behind the compute
    assert timeline([1, 1, 1], post=[1, 1, 1]) == 4
    assert timeline([1, 1, 1], post=[2, 2, 2]) == 7  # the link is the bottleneck
    assert timeline([1, 1, 1], post=[2, 2, 2], in_flight=1) == 7  # ... and compute waits for it
    assert timeline([3], post=[1]) == 4  # one bucket: nothing overlaps
    # gathers: issued when their segment starts (no prefetch), one segment ahead, or all at once
    assert timeline([1, 1, 1], pre=[1, 1, 1], ahead=0) == 6
    assert timeline([1, 1, 1], pre=[1, 1, 1], ahead=1) == 4
    assert timeline([1, 1, 1], pre=[1, 1, 1], ahead=None) == 4
    assert timeline([1, 1, 1], pre=[2, 2, 2], ahead=2) == 7  # gathers slower than compute


def test_planner_cuts_the_gradient_buckets_the_engine_cuts():
    from types import SimpleNamespace

    from zerotron.planner.overlap import grad_buckets
    from zerotron.zero import _bucketed
    from zerotron.zero.flat import bucket_numel
    from zerotron.zero.shard_group import is_expert_param

    # a mixture at ep 2: a rank holds 2 of the 4 experts, each bucket of one shard group (dense or experts)
    moe = dict(n_experts=4, top_k=2, expert_ffn=96)
    for overrides, ep in (
        ({}, 1),
        ({"n_layer": 4, "n_kv_head": 4}, 1),
        ({"tie_embeddings": True}, 1),
        (moe, 1),
        (moe, 2),
    ):
        model = make_model(**overrides)
        shape = ModelShape.of_gpt(model.config)
        for name, p in model.named_parameters():
            if ep > 1 and "experts" in name:  # this rank's experts, marked as the engine marks them
                p.data, p.allreduce = p.data[: 4 // ep].clone(), False
        groups = SimpleNamespace(of=lambda p: "expert" if is_expert_param(p) else "dense")
        params = list(model.parameters())
        for configured in (None, 20_000, 5e8):
            engine = [
                (sum(p.numel() for p in b), is_expert_param(b[0]))
                for b in _bucketed(params, bucket_numel(configured, sum(p.numel() for p in params)), groups)
            ]
            planner = [(k.elements, k.expert) for k in grad_buckets(shape, 1, 1, 16, configured, ep)]
            assert planner == engine, (overrides, ep, configured)


def test_step_time_models_bucketed_reduction_prefetch_depth_and_tp_overlap():
    cost, hardware = _cost()
    shape = ModelShape.parse("1.3b")
    hw = hardware.hardware("a100-80")
    slow = hw.with_overrides(intra_gbps=100, inter_gbps=100)
    # the boundary reduction, one bucket (reduce_bucket_size large) or zerotron's ~8: with the link
    # faster than backward, only the last bucket is left after backward (~1/8 of the reduction)
    for zero in (0, 1):
        layout = cost.Layout(dp=8, zero=zero, micro_batch=2)
        one = cost.step_time(shape, layout, 2048, slow, bucket_elements=2 * 10**9)["data_parallel"]
        eight = cost.step_time(shape, layout, 2048, slow)["data_parallel"]
        after_step = 0 if zero == 0 else one / 2  # stage 1: the reduce-scatter's half, then the step's gather
        assert (eight - after_step) < 0.25 * (one - after_step)
    # ZeRO-3's prefetch depth: 0 gathers each layer when it starts, so nothing hides the gathers
    slower = hw.with_overrides(intra_gbps=20, inter_gbps=20)
    times = [
        cost.step_time(shape, cost.Layout(dp=8, zero=3, micro_batch=2, stage3_prefetch=p), 2048, slower)[
            "data_parallel"
        ]
        for p in (0, 1, 50_000_000)
    ]
    assert times[0] > times[1] == times[2] > 0  # 5e7 is one 1.3b layer ahead, as 1 element is
    # tensor parallelism: two halves, one half's collective under the other's compute. Where compute
    # outweighs the collectives, one half's is left (a little more: each half pays the latency; here
    # 35 us of bandwidth and 16 of latency per half, against 70 + 16 whole)
    for sp in (False, True):
        plain, halves = (
            cost.step_time(
                shape, cost.Layout(dp=4, tp=2, zero=1, micro_batch=2, sequence_parallel=sp, tp_overlap_comm=o), 2048, hw
            )["tensor_parallel"]
            for o in (False, True)
        )
        assert 0.5 < halves / plain < 0.62
        # hardware that cannot compute beside a collective (overlap 0) gains nothing
        none = hw.with_overrides(overlap=0.0)
        assert (
            cost.step_time(
                shape,
                cost.Layout(dp=4, tp=2, zero=1, micro_batch=2, sequence_parallel=sp, tp_overlap_comm=True),
                2048,
                none,
            )["tensor_parallel"]
            >= plain
        )
