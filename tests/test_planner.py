"""The planner's model-state memory against what engines really hold (memory_report)."""

import pytest
import torch
from distributed import run_ranks
from parity import ds_config, make_model

import zerotron
from zerotron.parallelize import to_pipeline
from zerotron.planner import ModelShape, model_state_bytes


def _report(stage, tp, pp, bf16, offload, threshold):
    zero = {"stage": stage, "stage3_param_persistence_threshold": threshold}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    model = make_model(n_layer=4, n_kv_head=4)
    module = to_pipeline(model, pp, partition_method="type:_PipeBlock") if pp > 1 else model
    # Two micro-batches: stage 1 holds the full buckets it accumulates (the paper's 2Ψ). A one-micro-batch
    # step never holds them all: the boundary backward reduces each bucket as soon as it is filled.
    engine, *_ = zerotron.initialize(
        model=module,
        config=ds_config(1, 2, zero_optimization=zero, tensor_parallel={"autotp_size": tp}, bf16={"enabled": bf16}),
    )
    x = torch.randint(0, 256, (1, 16))
    engine.train_batch(iter([(x, x)] * 2))  # optimizer states exist after a step
    # Measured in the second step: the states as the step begins, and the gradients at their
    # most during backward (stage 1's full buckets exist until the boundary reduces them; every
    # stage frees its gradients at the step, so after it a rank holds none).
    held, grads, check = [], [0], engine.states.unscale_and_check

    def measure_then_check(*args):
        held.append(engine.memory_report())
        return check(*args)

    engine.states.unscale_and_check = measure_then_check
    for p in engine.module.parameters():  # after the engine's own hooks: what each arrival leaves held
        p.register_post_accumulate_grad_hook(lambda p: grads.append(engine.memory_report()["grads"]))
    engine.train_batch(iter([(x, x)] * 2))
    report = held[0]
    peak = max(grads + [report["grads"]])
    return {**report, "grads": peak, "total": report["total"] - report["grads"] + peak}, engine.predicted_memory()


@pytest.mark.parametrize(
    "world,stage,tp,pp,bf16,offload,threshold",
    [
        (2, 0, 1, 1, False, False, 0),
        (2, 0, 1, 1, True, False, 0),
        (2, 1, 1, 1, False, False, 0),
        (2, 2, 1, 1, True, False, 0),
        (2, 3, 1, 1, False, False, 0),
        (2, 3, 1, 1, True, False, 10_000),
        (4, 1, 2, 1, False, False, 0),
        (4, 1, 1, 2, False, False, 0),
        (8, 1, 2, 2, True, False, 0),
        (2, 2, 1, 1, False, True, 0),
        (2, 3, 1, 1, True, True, 0),
    ],
)
def test_model_state_memory_matches_the_engine(world, stage, tp, pp, bf16, offload, threshold):
    reports, own = zip(*run_ranks(_report, world, stage, tp, pp, bf16, offload, threshold))
    for measured, predicted in zip(reports, own):  # what each engine logs after its first step
        for key in ("params", "grads", "master_weights", "optimizer", "total", "host"):
            assert predicted.get(key, 0) == pytest.approx(measured.get(key, 0), rel=0.01, abs=64), key
    shape = ModelShape.of_gpt(make_model(n_layer=4, n_kv_head=4).config)
    predicted = model_state_bytes(
        shape,
        dp=world // (tp * pp),
        tp=tp,
        pp=pp,
        stage=stage,
        dtype="bf16" if bf16 else "fp32",
        offload_optimizer=offload,
        persistence_threshold=threshold,
    )
    measured = max(reports, key=lambda r: r["total"])
    for key in ("params", "grads", "master_weights", "optimizer", "total"):  # padding and step counters aside
        assert predicted[key] == pytest.approx(measured[key], rel=0.01, abs=64), key
    assert predicted.get("host", 0) == pytest.approx(measured.get("host", 0), rel=0.01, abs=64)


def test_parameter_count_matches_the_model():
    for overrides in ({}, {"tie_embeddings": True}, {"n_kv_head": 2}):
        model = make_model(**overrides)
        assert ModelShape.of_gpt(model.config).parameters == model.num_params()


def test_estimate_command():
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "zerotron.cli", "estimate", "--model", "7b", "--dp", "8"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    rows = [line.split() for line in out.stdout.splitlines() if line.strip()[:1].isdigit() and len(line.split()) == 7]
    device = [float(r[5]) for r in rows]
    assert len(device) == 4 and device == sorted(device, reverse=True)  # each ZeRO stage holds less
    shape = ModelShape.of_gpt(__import__("zerotron.models.gpt", fromlist=["config_for"]).config_for("7b"))
    # stage 3 in bf16: 14Ψ/N (the paper's 16Ψ/N without a bf16 parameter shard beside the masters)
    assert device[3] == pytest.approx(14 * shape.parameters / 8 / 2**30, rel=0.01)
    # ... and the table says why its params column is near 0 at stage 3 and its grads are 6 B/param at stage 0
    assert "ZeRO 3 params: only those under the persistence threshold" in out.stdout
    assert "ZeRO 0 grads: the model's bf16 gradients (2 B/param) and the fp32 gradients" in out.stdout
    fp32 = subprocess.run(
        [sys.executable, "-m", "zerotron.cli", "estimate", "--model", "7b", "--precision", "fp32"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "ZeRO 0 grads" not in fp32.stdout and "ZeRO 3 params" not in fp32.stdout


def _saved_for_backward(model, tokens, targets, forward=None) -> int:
    """Bytes of the distinct non-parameter tensors autograd keeps from one forward."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if key not in params:
            seen[key] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = (forward or model)(tokens, targets)
    return sum(seen.values()), loss


def _kept_by_forward(model, tokens, targets) -> int:
    """Bytes a forward leaves allocated (the profiler's allocations minus frees): what selective
    checkpointing caches is kept outside autograd's saved tensors, so hooks do not see it."""
    import gc

    from torch.profiler import ProfilerActivity, profile

    gc.collect()  # earlier tests' garbage freed inside the window would count as negative allocations
    gc.disable()
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            loss = model(tokens, targets)
    finally:
        gc.enable()
    del loss
    return sum(e.self_cpu_memory_usage for e in prof.events())


@pytest.mark.parametrize("size,batch,seq", [("small", 8, 128), ("large", 1, 64)])
@pytest.mark.parametrize("policy", ["none", "every_block", "every_k", "selective"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_activation_memory_matches_what_backward_keeps(size, batch, seq, policy, dtype):
    from zerotron import checkpointing
    from zerotron.models.gpt import GPT, config_for
    from zerotron.planner import activation_bytes

    cfg = config_for(size, max_seq_len=seq)
    torch.manual_seed(0)
    model = GPT(cfg).to(torch.bfloat16 if dtype == "bf16" else torch.float32)
    checkpointing.apply_policy(model, policy, every=2)
    g = torch.Generator().manual_seed(0)
    tokens, targets = (torch.randint(0, cfg.vocab_size, (batch, seq), generator=g) for _ in range(2))
    if policy == "selective":
        measured = _kept_by_forward(model, tokens, targets)
    else:
        measured, loss = _saved_for_backward(model, tokens, targets)
        loss.backward()
    predicted = activation_bytes(ModelShape.of_gpt(cfg), batch, seq, policy, dtype=dtype)
    assert predicted == pytest.approx(measured, rel=0.02)  # the issue asks for 15%


def _tp_saved(sp, bf16, policy, partition):
    from zerotron.models.gpt import GPT, config_for

    torch.manual_seed(0)
    extra = {"activation_checkpointing": {"partition_activations": True}} if partition else {}
    engine, *_ = zerotron.initialize(
        model=GPT(config_for("small", n_layer=3, max_seq_len=64)),
        config=ds_config(
            2,
            1,
            tensor_parallel={"autotp_size": 2},
            bf16={"enabled": bf16},
            zerotron={"sequence_parallel": sp, "checkpoint_policy": policy},
            **extra,
        ),
    )
    g = torch.Generator().manual_seed(0)
    tokens, targets = (torch.randint(0, 256, (2, 64), generator=g) for _ in range(2))
    measured, loss = _saved_for_backward(engine.module, tokens, targets, forward=engine)
    engine.backward(loss)
    return measured


@pytest.mark.parametrize(
    "sp,bf16,policy,partition",
    [
        (False, False, "none", False),
        (True, False, "none", False),
        (False, True, "none", False),
        (True, True, "none", False),
        (False, False, "every_block", True),
        (True, True, "every_block", False),
        (False, True, "every_k", False),
    ],
)
def test_activation_memory_under_tensor_and_sequence_parallelism(sp, bf16, policy, partition):
    from zerotron.models.gpt import config_for
    from zerotron.planner import activation_bytes

    measured = run_ranks(_tp_saved, 2, sp, bf16, policy, partition)
    predicted = activation_bytes(
        ModelShape.of_gpt(config_for("small", n_layer=3)),
        2,
        64,
        policy,
        dtype="bf16" if bf16 else "fp32",
        tp=2,
        sp=sp,
        partition_activations=partition,
    )
    for m in measured:
        assert predicted == pytest.approx(m, rel=0.02)


def test_sequence_parallelism_keeps_less_than_tensor_parallelism_alone():
    from zerotron.models.gpt import config_for

    shape = ModelShape.of_gpt(config_for("1.3b"))
    from zerotron.planner import activation_bytes

    assert activation_bytes(shape, 1, 2048, tp=8, sp=True, dtype="bf16") < 0.8 * activation_bytes(
        shape, 1, 2048, tp=8, dtype="bf16"
    )


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


# ---- the search and the command ------------------------------------------------------------------------
def test_search_yields_only_valid_layouts_ranked_by_speed():
    from zerotron.config import Config
    from zerotron.planner import hardware
    from zerotron.planner.search import deepspeed_config, plan

    shape = ModelShape.parse("llama2-13b")
    hw = hardware.hardware("a100-40")
    candidates = plan(shape, 32, hw, 4096, 256)
    fitting = [c for c in candidates if c.rejected is None]
    assert fitting and len(fitting) < len(candidates)  # at 13B on 40 GB some layouts cannot fit
    speeds = [c.tokens_per_s for c in fitting]
    assert speeds == sorted(speeds, reverse=True)
    for c in candidates:
        L = c.layout
        assert L.dp * L.tp * L.pp == 32 and L.dp * L.micro_batch * L.grad_accum == 256
        assert shape.heads % L.tp == 0 and L.tp <= hw.gpus_per_node and not (L.pp > 1 and L.zero == 3)
        assert (c.rejected is None) == (
            c.memory["total"] <= (hw.memory_gib - hw.reserve_gib) * 2**30
            and c.memory["host"] * 8 <= hw.host_gib * 2**30 * 0.9
        )
    assert any(c.layout.zero == 0 and "GiB per GPU" in c.rejected for c in candidates if c.rejected)
    for c in fitting[:20]:  # the configs it writes are ones the engine accepts
        cfg = Config.load(deepspeed_config(c.layout, 256), world_size=32, pipeline_stages=c.layout.pp)
        assert cfg.train_batch_size == 256 and cfg.zero_optimization.stage == c.layout.zero


def test_plan_command_writes_a_config_that_trains(tmp_path):
    import json
    import subprocess
    import sys

    out, png = tmp_path / "plan.json", tmp_path / "plan.png"
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "zerotron.cli",
            "plan",
            "--model",
            "tiny",
            "--gpus",
            "2",
            "--hardware",
            "cpu",
            "--seq",
            "64",
            "--global-batch",
            "8",
            "--precision",
            "fp32",
            "--out",
            str(out),
            "--plot",
            str(png),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert "tokens/s" in run.stdout and png.stat().st_size > 10_000
    config = json.loads(out.read_text())
    train = subprocess.run(
        [
            sys.executable,
            "-m",
            "zerotron.cli",
            "train",
            "--model",
            "tiny",
            "--config",
            str(out),
            "--seq-len",
            "64",
            "--steps",
            "2",
            "--eval-batches",
            "1",
            "--sample-bytes",
            "0",
            "--corpus-bytes",
            "20000",
            "--nproc",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=tmp_path,
    )
    assert train.returncode == 0, train.stderr[-3000:]
    assert "model states: predicted" in train.stderr  # the engine's start-up prediction next to the measurement
    assert config["train_batch_size"] == 8


@pytest.mark.parametrize("model,gpus,batch", [("125m", 1, 8), ("1.3b", 8, 64)])
def test_a_plan_lists_no_two_layouts_a_user_cannot_tell_apart(model, gpus, batch):
    """At one data-parallel rank, ZeRO-2 shards gradients over one rank (ZeRO-1) and there is nothing
    to overlap a parameter gather with: such rows would repeat others, memory and speed alike."""
    from collections import Counter

    from zerotron.planner import hardware
    from zerotron.planner.search import plan

    candidates = plan(ModelShape.parse(model), gpus, hardware.hardware("h100"), 4096, batch)

    def shown(c):  # what a row of the table says, but the ZeRO stage and its options
        L = c.layout
        return (
            round(c.memory["total"] / 2**20),
            round(c.memory.get("host", 0) / 2**20),
            round(c.tokens_per_s),
            L.dp,
            L.tp,
            L.pp,
            L.micro_batch,
            L.checkpoint,
            L.offload,
            L.schedule,
            L.chunks,
        )

    repeated = [k for k, n in Counter(map(shown, candidates)).items() if n > 1]
    assert not repeated, [c.layout.describe() for c in candidates if shown(c) == repeated[0]]


def test_plot_without_matplotlib_is_refused_before_the_plan_is_written(tmp_path, monkeypatch, capsys):
    import sys

    from zerotron.cli import main

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    out = tmp_path / "p.json"
    code = main(
        [
            "plan",
            "--model",
            "125m",
            "--gpus",
            "1",
            "--global-batch",
            "8",
            "--out",
            str(out),
            "--plot",
            str(tmp_path / "p.png"),
        ]
    )
    assert code == 2 and not out.exists()
    assert "pip install 'zerotron[plot]'" in capsys.readouterr().err


def test_plan_command_says_when_nothing_fits(tmp_path):
    import subprocess
    import sys

    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "zerotron.cli",
            "plan",
            "--model",
            "llama3-70b",
            "--gpus",
            "2",
            "--hardware",
            "a100-40",
            "--seq",
            "4096",
            "--global-batch",
            "8",
            "--no-offload",
            "--out",
            str(tmp_path / "p.json"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 3 and "nothing fits" in run.stdout and "needs" in run.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "zerotron.cli", "plan", "--model", "nonsense", "--gpus", "2", "--global-batch", "8"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "unknown model" in bad.stderr


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
    from zerotron.planner.overlap import grad_buckets
    from zerotron.zero import _bucketed
    from zerotron.zero.flat import bucket_numel

    for overrides in ({}, {"n_layer": 4, "n_kv_head": 4}, {"tie_embeddings": True}):
        model = make_model(**overrides)
        params = list(model.parameters())
        for configured in (None, 20_000, 5e8):
            engine = [
                sum(p.numel() for p in b)
                for b in _bucketed(params, bucket_numel(configured, sum(p.numel() for p in params)))
            ]
            planner = [n for n, _ in grad_buckets(ModelShape.of_gpt(model.config), 1, 1, 16, configured)]
            assert planner == engine, (overrides, configured)


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
