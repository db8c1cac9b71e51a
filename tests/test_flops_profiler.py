"""The flops profiler (zerotron/profiling; DeepSpeed's deepspeed.profiling.flops_profiler) against torch's own
FLOP counter and the 6N + 12·L·d·s formula on the reference GPT; the engine's profile_step hook; the comms log
(deepspeed.comm.log_summary) against engine.comm_stats()."""

from __future__ import annotations

import torch
from distributed import run_ranks
from torch.utils.flop_counter import FlopCounterMode

import zerotron
from zerotron.models.gpt import GPT, GPTConfig
from zerotron.profiling import FlopsProfiler, get_model_profile
from zerotron.profiling.flops import _CPU_ATTENTION, get_module_flops

SEQ = 16


def _gpt():
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, d_model=32, n_head=4, n_kv_head=2, vocab_size=64, max_seq_len=SEQ))


def test_totals_equal_torchs_counter_and_the_formula():
    model, tokens = _gpt(), torch.randint(0, 64, (2, SEQ))
    flops, macs, params = get_model_profile(model, args=[tokens], print_profile=False, as_string=False)
    with torch.no_grad(), FlopCounterMode(display=False, custom_mapping=_CPU_ATTENTION) as counter:
        model(tokens)
    assert flops == counter.get_total_flops() > 0 and macs * 2 == flops and params == model.num_params()
    # 6N + 12·L·d·s per token is three forwards; its N also counts the norms' weights, which no matmul meets
    norms = sum(p.numel() for n, p in model.named_parameters() if "norm" in n)
    assert 3 * flops == tokens.numel() * (model.flops_per_token(SEQ) - 6 * norms)


def test_profiler_api_per_module_and_output_file(tmp_path):
    model, tokens = _gpt(), torch.randint(0, 64, (2, SEQ))
    prof = FlopsProfiler(model)
    prof.print_model_profile(output_file=str(tmp_path / "never.txt"))  # not started: nothing, as DeepSpeed
    prof.start_profile()
    loss = model(tokens, tokens)
    prof.stop_profile()
    loss.backward()  # after stop: not counted
    layers = get_module_flops(model.layers)
    assert layers == sum(get_module_flops(b) for b in model.layers) > 0
    assert prof.get_total_flops() == layers + get_module_flops(model.lm_head)
    assert prof.get_total_flops(as_string=True).endswith(" M") and prof.get_total_duration() > 0
    prof.print_model_profile(profile_step=3, module_depth=2, top_modules=2, output_file=str(tmp_path / "p.txt"))
    text = (tmp_path / "p.txt").read_text()
    assert "Profile at step 3" in text and "(lm_head): Linear(" in text and "depth 1:" in text
    assert not (tmp_path / "never.txt").exists()
    prof.end_profile()
    assert prof.get_total_flops() == 0


def test_engine_profiles_profile_step_and_costs_nothing_when_off(tmp_path):
    def run(section):
        model = _gpt()
        config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
        engine, *_ = zerotron.initialize(model=model, config={**config, "flops_profiler": section})
        for _ in range(3):
            tokens = torch.randint(0, 64, (2, SEQ))
            engine.backward(engine(tokens, tokens))
            engine.step()
        return engine

    off = run({"enabled": False})
    assert off.reporter.flops_profile is None and not off.module._forward_pre_hooks
    out = tmp_path / "profile.txt"
    on = run({"enabled": True, "profile_step": 1, "detailed": False, "output_file": str(out)})
    text = out.read_text()
    assert "Profile at step 1" in text and "batch size per GPU:" in text and "iter latency:" in text
    tokens = torch.randint(0, 64, (2, SEQ))
    expected = get_model_profile(_gpt(), args=[tokens, tokens], print_profile=False, as_string=False)
    assert on.reporter.flops_profile.totals == dict(zip(("flops", "macs", "params"), expected))
    assert not on.module._forward_pre_hooks and not on.module._forward_hooks  # all removed after the step


def _comms():
    import zerotron.comm as comm

    model = _gpt()
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"stage": 2},
        "comms_logger": {"enabled": True},
    }
    engine, *_ = zerotron.initialize(model=model, config=config)
    comm.reset_log()
    engine.reset_comm_stats()
    for _ in range(2):
        tokens = torch.randint(0, 64, (2, SEQ))
        engine.backward(engine(tokens, tokens))
        engine.step()
    comm.all_reduce(torch.ones(10), log_name="mine")
    summary = comm.log_summary(return_dict=True, show_straggler=True)
    logged = {
        name: sum(s["msg_size_bytes"] * s["count"] for s in sizes.values())
        for name, sizes in summary["summary"].items()
    }
    comm.configure(enabled=False)
    return logged, engine.comm_stats(), summary["straggler_analysis"] is not None


def test_comms_logger_logs_what_comm_stats_counts():
    for logged, stats, stragglers in run_ranks(_comms, 2, timeout=90):
        assert logged["mine"] == 40 and stragglers
        for kind in ("reduce_scatter", "all_gather"):
            assert logged[kind] == stats[kind] > 0
