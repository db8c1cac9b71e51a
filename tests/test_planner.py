"""The planner's model-state memory against what engines really hold (memory_report)."""
import pytest
import torch

import zerotron
from distributed import run_ranks
from parity import ds_config, make_model
from zerotron.planner import ModelShape, model_state_bytes


def _report(stage, tp, pp, bf16, offload, threshold):
    zero = {"stage": stage, "stage3_param_persistence_threshold": threshold}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    model = make_model(n_layer=4, n_kv_head=4)
    module = model.to_pipeline(pp, partition_method="type:_PipeBlock") if pp > 1 else model
    engine, *_ = zerotron.initialize(model=module, config=ds_config(
        1, 2 if pp > 1 else 1, zero_optimization=zero, tensor_parallel={"autotp_size": tp}, bf16={"enabled": bf16}))
    x = torch.randint(0, 256, (1, 16))
    engine.train_batch(iter([(x, x)] * (2 if pp > 1 else 1)))  # optimizer states exist after a step
    return engine.memory_report()


@pytest.mark.parametrize("world,stage,tp,pp,bf16,offload,threshold", [
    (2, 0, 1, 1, False, False, 0), (2, 0, 1, 1, True, False, 0), (2, 1, 1, 1, False, False, 0),
    (2, 2, 1, 1, True, False, 0), (2, 3, 1, 1, False, False, 0), (2, 3, 1, 1, True, False, 10_000),
    (4, 1, 2, 1, False, False, 0), (4, 1, 1, 2, False, False, 0), (8, 1, 2, 2, True, False, 0),
    (2, 2, 1, 1, False, True, 0), (2, 3, 1, 1, True, True, 0)])
def test_model_state_memory_matches_the_engine(world, stage, tp, pp, bf16, offload, threshold):
    reports = run_ranks(_report, world, stage, tp, pp, bf16, offload, threshold)
    shape = ModelShape.of_gpt(make_model(n_layer=4, n_kv_head=4).config)
    predicted = model_state_bytes(shape, dp=world // (tp * pp), tp=tp, pp=pp, stage=stage,
                                  dtype="bf16" if bf16 else "fp32", offload_optimizer=offload,
                                  persistence_threshold=threshold)
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
    out = subprocess.run([sys.executable, "-m", "zerotron.cli", "estimate", "--model", "7b", "--dp", "8"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    rows = [line.split() for line in out.stdout.splitlines() if line.strip()[:1].isdigit() and len(line.split()) == 7]
    device = [float(r[5]) for r in rows]
    assert len(device) == 4 and device == sorted(device, reverse=True)  # each ZeRO stage holds less
    shape = ModelShape.of_gpt(__import__("zerotron.models.gpt", fromlist=["config_for"]).config_for("7b"))
    assert device[3] == pytest.approx(16 * shape.parameters / 8 / 2**30, rel=0.01)  # stage 3 in bf16: 16Ψ/N


def _saved_for_backward(model, tokens) -> int:
    """Bytes of the distinct non-parameter tensors autograd keeps from one forward."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        key = t.untyped_storage().data_ptr()
        if key not in params:
            seen[key] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(tokens, tokens)
    loss.backward()
    return sum(seen.values())


@pytest.mark.parametrize("size,batch,seq", [("small", 8, 128), ("medium", 4, 64), ("large", 2, 128)])
@pytest.mark.parametrize("policy", ["none", "every_block", "every_k"])
def test_activation_memory_matches_what_backward_keeps(size, batch, seq, policy):
    from zerotron import checkpointing
    from zerotron.models.gpt import GPT, config_for
    from zerotron.planner import activation_bytes
    cfg = config_for(size, max_seq_len=seq)
    torch.manual_seed(0)
    model = GPT(cfg)
    checkpointing.apply_policy(model, policy, every=2)
    measured = _saved_for_backward(model, torch.randint(0, cfg.vocab_size, (batch, seq)))
    assert activation_bytes(ModelShape.of_gpt(cfg), batch, seq, policy) == pytest.approx(measured, rel=0.01)
