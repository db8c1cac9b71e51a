"""The planner and mixtures of experts (planner/experts.py, issue 31): shapes and parameter counts from
zerotron's sizes, specs and Hugging Face configs; the all-to-all bytes and activations against what the
engine sends and keeps under expert parallelism; the step-time terms; and the search, which proposes
expert parallelism only for mixtures on data parallelism alone, and where nothing else fits."""

import pytest
import torch
from distributed import run_ranks
from parity import ds_config, make_model

from zerotron.planner import ModelShape, hardware
from zerotron.planner.cost import Layout, step_time
from zerotron.planner.experts import all_to_all_bytes

MOE = dict(n_experts=4, top_k=2, expert_ffn=96)  # moe-tiny's shape
# Too large for any layout without expert parallelism on 64 H100s: one block's experts are 51.5B
# parameters, more than a GPU holds whole (ZeRO 0-2, tensor parallelism keeps experts whole) or gathers
# (ZeRO-3), whatever the pipeline split
HUGE = "layers=4,hidden=8192,heads=64,kv_heads=8,vocab=32000,experts=256,top_k=8,expert_ffn=8192"


# ---- shapes ------------------------------------------------------------------------------------------
def test_moe_shapes_from_sizes_specs_and_hugging_face_configs():
    from transformers import AutoModelForCausalLM, MixtralConfig

    tiny = ModelShape.parse("moe-tiny")
    assert (tiny.experts, tiny.top_k, tiny.expert_ffn, tiny.shared_ffn) == (4, 2, 96, 0)
    assert tiny == ModelShape.parse("layers=2,hidden=64,heads=4,kv_heads=2,vocab=256,experts=4,expert_ffn=96")
    # Mixtral 8x7B (Transformers' MixtralConfig defaults are its shape): 46.7B parameters, 12.9B per token
    mixtral = ModelShape.from_hf_config(MixtralConfig().to_dict())
    assert mixtral == ModelShape.parse("mixtral-8x7b")
    assert mixtral.parameters == pytest.approx(46.70e9, rel=1e-3)
    assert mixtral.active_parameters == pytest.approx(12.88e9, rel=1e-3)
    small = MixtralConfig(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, num_local_experts=4)  # fmt: skip
    assert (
        ModelShape.from_hf_config(small.to_dict()).parameters
        == AutoModelForCausalLM.from_config(small).num_parameters()
    )
    # Qwen3-MoE: experts sized by moe_intermediate_size (intermediate_size is for dense layers);
    # DeepSeek: n_routed_experts and n_shared_experts of moe_intermediate_size (MLA costed as attention)
    qwen = {"hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
            "intermediate_size": 6144, "moe_intermediate_size": 768, "num_experts": 128,
            "num_experts_per_tok": 8, "vocab_size": 151936}  # fmt: skip
    deepseek = {"hidden_size": 7168, "num_hidden_layers": 61, "num_attention_heads": 128, "intermediate_size": 18432,
                "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1,
                "num_experts_per_tok": 8, "vocab_size": 129280}  # fmt: skip
    for config, fields in ((qwen, (128, 8, 768, 0)), (deepseek, (256, 8, 2048, 2048))):
        shape = ModelShape.from_hf_config(config)
        assert (shape.experts, shape.top_k, shape.expert_ffn, shape.shared_ffn) == fields
        routed = shape.layers * shape.experts * 3 * shape.hidden * shape.expert_ffn
        assert shape.expert_parameters == routed
        assert shape.parameters - shape.active_parameters == routed // shape.experts * (shape.experts - shape.top_k)
    for bad, message in (("layers=2,hidden=64,heads=4,vocab=8,experts=4,top_k=5", "top_k <= experts"),
                         ("layers=2,hidden=64,heads=4,vocab=8,top_k=2", "set experts")):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            ModelShape.parse(bad)


# ---- against the engine: the tokens' all-to-alls and the activations -----------------------------------
def _uniform_routing(mlp):
    """Token i to experts i and i + 1 (mod E): each expert gets T·k/E rows of every rank's T tokens."""
    experts = mlp.router.out_features

    def router(tokens):
        i = torch.arange(tokens.shape[0])
        logits = torch.zeros(tokens.shape[0], experts, dtype=tokens.dtype)
        logits[i, i % experts], logits[i, (i + 1) % experts] = 2.0, 1.0
        return logits + 0 * torch.nn.functional.linear(tokens, mlp.router.weight)  # (the weight still trains)

    mlp.router.forward = router


def _exchanged_and_kept(bf16, policy, gas):
    from test_planner_memory import _saved_for_backward

    import zerotron

    model = make_model(**MOE)
    for layer in model.layers:
        _uniform_routing(layer.mlp)
    config = ds_config(2, gas, zero_optimization={"stage": 1}, bf16={"enabled": bf16},
                       expert_parallel={"enabled": True, "autoep_size": 2},
                       zerotron={"checkpoint_policy": policy})  # fmt: skip
    engine, *_ = zerotron.initialize(model=model, config=config)
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    engine.train_batch(iter([(x, x)] * gas))
    before = engine.comm_stats()["all_to_all"]
    engine.train_batch(iter([(x, x)] * gas))
    exchanged = engine.comm_stats()["all_to_all"] - before
    kept, loss = _saved_for_backward(engine.module, x, x, forward=engine)
    engine.backward(loss)
    return exchanged, kept


@pytest.mark.parametrize(
    "bf16,policy,gas", [(False, "none", 1), (True, "every_block", 2), (False, "selective", 1)]
)  # (selective: the grouped expert GEMMs are recomputed, their exchanges with them)
def test_all_to_all_bytes_and_activations_match_the_engine(bf16, policy, gas):
    """moe-tiny at world 2, ep 2, routing made uniform: every rank sends exactly the planner's bytes per
    step (the recomputed forwards exchanging again) and keeps its activations for backward."""
    from zerotron.planner import activation_bytes

    shape, a = ModelShape.parse("moe-tiny"), 2 if bf16 else 4
    per_layer = all_to_all_bytes(shape, 2 * 16, 2, a)
    assert per_layer["rows"] == 2 * 16 * 2 * 64 * a / 2  # T·k·h·a·(ep-1)/ep
    again = 0 if policy == "none" else 1
    step = gas * shape.layers * (per_layer["forward"] * (1 + again) + per_layer["backward"])
    dtype = "bf16" if bf16 else "fp32"
    kept = activation_bytes(shape, 2, 16, policy, dtype=dtype, ep=2)
    for exchanged, measured in run_ranks(_exchanged_and_kept, 2, bf16, policy, gas, timeout=120):
        assert exchanged == step
        if policy != "selective":  # (its kept matmul outputs are no saved tensors: test_planner_memory)
            assert kept == pytest.approx(measured, rel=0.01)


# ---- step time -------------------------------------------------------------------------------------------
def test_step_time_of_expert_parallelism():
    shape = ModelShape.parse(HUGE)
    hw = hardware.hardware("h100")
    free = hw.with_overrides(intra_latency_us=0, inter_latency_us=0)
    base, ep = (Layout(dp=8, zero=1, micro_batch=1, ep=e) for e in (1, 8))
    plain, split = step_time(shape, base, 4096, free), step_time(shape, ep, 4096, free)
    # four all-to-alls per layer of T·k·h·a·(ep-1)/ep bytes, at the busiest rank's 1.25x, over NVLink
    one = 4096 * 8 * 8192 * 2 * 7 / 8 * 1.25
    assert plain["expert_all_to_all"] == 0
    assert split["expert_all_to_all"] == pytest.approx(4 * 4 * one / (hw.intra_gbps * 1e9), rel=1e-3)
    # the busiest rank's experts run 1.25x the mean rows
    experts = shape.expert_flops_per_token()
    assert split["compute"] / plain["compute"] == pytest.approx(
        (shape.flops_per_token(4096) + 0.25 * experts) / shape.flops_per_token(4096)
    )
    # each expert on one rank of the node: only the dense 0.5% of the gradients is reduced
    assert split["data_parallel"] < 0.02 * plain["data_parallel"]
    # beyond a node (ep 16), 8/15 of each rank's rows leave through its own NIC (1/8 of NVLink's bandwidth)
    wide = step_time(shape, Layout(dp=64, zero=1, micro_batch=1, ep=16), 4096, free)["expert_all_to_all"]
    remote = 4096 * 8 * 8192 * 2 * 15 / 16 * 1.25 * 8 / 15 / (hw.inter_gbps * 1e9)
    assert wide == pytest.approx(4 * 4 * remote, rel=1e-3)
    with pytest.raises(ValueError, match="data parallelism only"):
        Layout(dp=32, tp=2, ep=2)


# ---- the search ------------------------------------------------------------------------------------------
def test_search_proposes_expert_parallelism_where_only_it_fits():
    from zerotron.config import Config
    from zerotron.planner.search import deepspeed_config, plan

    shape = ModelShape.parse(HUGE)
    candidates = plan(shape, 64, hardware.hardware("h100"), 4096, 64)
    fitting = [c for c in candidates if c.rejected is None]
    assert fitting and all(c.layout.ep > 1 for c in fitting)
    assert any(c.layout.ep == 1 for c in candidates)  # costed, and too large
    for c in candidates:  # expert parallelism on data parallelism alone, as the engine runs it
        L = c.layout
        assert L.ep == 1 or (L.tp == L.pp == L.sequence_ranks == 1 and L.dp % L.ep == 0 and 256 % L.ep == 0)
        assert not (L.tp > 1 and L.sequence_parallel)  # the engine refuses it for a mixture's experts
    best = fitting[0].layout
    config = deepspeed_config(best, 64)
    assert config["expert_parallel"] == {"enabled": True, "autoep_size": best.ep}
    assert Config.load(config, world_size=64).expert_parallel.size == best.ep
    # a dense model: never
    assert all(c.layout.ep == 1 for c in plan(ModelShape.parse("llama2-7b"), 16, hardware.hardware("h100"), 4096, 64))


def test_plan_command_lists_expert_parallel_layouts_for_a_hugging_face_config(tmp_path):
    import json
    import subprocess
    import sys

    from transformers import MixtralConfig

    # HUGE, written as Mixtral's config
    huge = MixtralConfig(hidden_size=8192, intermediate_size=8192, num_hidden_layers=4, num_attention_heads=64,
                         num_key_value_heads=8, num_local_experts=256, num_experts_per_tok=8)  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(huge.to_dict()))
    run = subprocess.run(
        [sys.executable, "-m", "zerotron.cli", "plan", "--model", str(tmp_path), "--gpus", "64", "--seq", "4096",
         "--global-batch", "64", "--out", str(tmp_path / "plan.json")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "207.30B parameters (7.58B active: 8 of 256 experts)" in run.stdout
    rows = [line for line in run.stdout.split("do not fit")[0].splitlines() if " dp64 " in line]
    assert rows and all(" ep" in row for row in rows)
    assert "expert_all_to_all" in run.stdout
    assert json.loads((tmp_path / "plan.json").read_text())["expert_parallel"]["enabled"]
