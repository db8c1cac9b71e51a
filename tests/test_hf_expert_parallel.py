"""Every Mixture-of-Experts causal-LM family of the installed Transformers (its experts module built
with Transformers' experts interface), tiny and random, with DeepSpeed's AutoEP config
(`"expert_parallel": {"enabled": true, "autoep_size": 2}`) on 2 ranks at ZeRO-2 and ZeRO-3, against
one process training the same rows: each family matches (losses within 1e-5 relative, every weight
within 1e-5, SGD with momentum and clipping so a wrong expert-gradient scale shows, the tokens
exchanged by all-to-all and each rank holding half the experts) or is refused with a ConfigError
before training. A family that cannot be built tiny or trained by plain PyTorch is counted apart
("unbuilt"). `python tests/test_hf_expert_parallel.py [family...]` prints the table."""

import inspect
import math
import sys

import family_sweep
import pytest
import torch
import transformers
from distributed import run_ranks
from hf_families import SAMPLES_IN_TRAINING, tiny_config
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

import zerotron

STEPS, ROWS, SEQ, VOCAB, LR = 3, 4, 16, 128, 0.05
LAYOUTS = {"ep2_zero2": 2, "ep2_zero3": 3}  # name -> ZeRO stage, expert parallelism 2 over 2 ranks
# what the generic tiny config misses for a family's experts
MOE_LAYERS = {
    "zaya": dict(num_experts_per_tok=1),  # its config accepts top-1 only (the generic tiny config asks for 2)
    "flint": dict(mlp_only_layers=[0]),  # layers 0 and 1 are dense by default
    "gemma4_text": dict(
        enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32
    ),  # off by default
}


def moe_families() -> list[tuple[str, str]]:
    """(family, causal-LM class) whose modeling code builds experts with Transformers' interface."""
    out, seen = [], set()
    for cls_name in sorted(set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())):
        cls = getattr(transformers, cls_name, None)
        if cls is None or cls_name in seen:
            continue
        seen.add(cls_name)
        try:
            source = open(inspect.getsourcefile(cls)).read()
        except (TypeError, OSError):
            continue
        if "@use_experts_implementation" in source:
            out.append((cls.config_class.model_type, cls_name))
    return sorted(out)


def _batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, VOCAB, (ROWS, SEQ), generator=g) for _ in range(STEPS)]


def _build(cls_name):
    model_cls, cfg = tiny_config(cls_name, MOE_LAYERS)
    torch.manual_seed(0)
    model = model_cls(cfg)
    return model.eval() if cfg.model_type in SAMPLES_IN_TRAINING else model


def _reference(cls_name, model=None):
    """One process holding every expert: SGD with momentum and clipping, as the engines below."""
    model = model if model is not None else _build(cls_name)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses = []
    for x in _batches():
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _config(stage, ep=2):
    config = {
        "train_micro_batch_size_per_gpu": ROWS // 2,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**6,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": 0.9}},
        "zero_allow_untested_optimizer": True,
    }
    if ep > 1:
        config["expert_parallel"] = {"enabled": True, "autoep_size": ep}
    return config


def _train(engine, steps=STEPS):
    """This rank's half of each of the next `steps` batches."""
    losses = []
    for x in _batches()[engine.global_steps : engine.global_steps + steps]:
        mine = x.chunk(2)[engine.coords.dp]
        losses.append(engine.train_batch(iter([{"input_ids": mine, "labels": mine}])).item())
    return losses


def _split(cls_name, stage, ref_losses, ref_weights):
    """('ok' | 'refused' | 'FAIL', detail) on this rank."""
    from zerotron.moe.stacked_experts import stacked_experts

    model = _build(cls_name)
    experts_before = sum(p.numel() for _, m in stacked_experts(model) for p in m.parameters(recurse=False))
    try:
        engine, *_ = zerotron.initialize(model=model, config=_config(stage))
    except zerotron.ConfigError as e:
        return "refused", str(e)
    experts_after = sum(math.prod(getattr(p, "ds_shape", p.shape))  # (ZeRO-3: the unit's full shape)
                        for _, m in stacked_experts(engine.module) for p in m.parameters(recurse=False))  # fmt: skip
    losses = _train(engine)
    exchanged = engine.comm_stats()["all_to_all"]
    weights = zerotron.zero.consolidated_state_dict(engine.module)
    loss_error = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    diffs = {n: (weights[n].float() - w.float()).abs().max().item() for n, w in ref_weights.items() if n in weights}
    missing = sorted(set(ref_weights) ^ set(weights))
    worst = max(diffs, key=diffs.get)
    detail = f"loss {loss_error:.1e}, weights {diffs[worst]:.1e} ({worst}), all-to-all {exchanged} B"
    if missing or loss_error > 1e-5 or diffs[worst] > 1e-5 or not exchanged or 2 * experts_after != experts_before:
        return "FAIL", detail + (f"; keys differ {missing[:3]}" if missing else f"; experts {experts_after}")
    return "ok", detail


def sweep(names=None) -> dict:
    """On each of 2 ranks: every MoE family (or those named), under each layout."""
    return family_sweep.sweep(moe_families(), LAYOUTS, _reference, _split, names)


@pytest.mark.timeout(1500)
def test_every_transformers_moe_family_matches_or_is_refused_under_expert_parallelism():
    results = run_ranks(sweep, 2, timeout=1400)
    print("\n" + family_sweep.check(results, LAYOUTS))
    assert len(results[0]) >= 40  # the MoE families are found


def _train_saved(directory, ep, stage, load, steps):
    """Mixtral at (ep, stage): `load` from directory, train `steps` of the sweep's batches, save."""
    engine, *_ = zerotron.initialize(model=_build("MixtralForCausalLM"), config=_config(stage, ep))
    if load:
        engine.load_checkpoint(directory)
    losses = _train(engine, steps)
    engine.save_checkpoint(directory)
    return losses


@pytest.mark.parametrize("resumed", [(1, 3), (2, 3)])
def test_a_checkpoint_saved_with_split_experts_resumes_with_them_whole_or_split(tmp_path, resumed):
    """Saved at ep 2 under ZeRO-2 after 2 steps, resumed at ep 1 or 2 under ZeRO-3 (the momentum with
    it): step 3's loss is one process's."""
    want, _ = _reference("MixtralForCausalLM")
    run_ranks(_train_saved, 2, tmp_path, 2, 2, False, 2, timeout=120)
    for losses in run_ranks(_train_saved, 2, tmp_path, *resumed, True, 1, timeout=120):
        assert abs(losses[0] - want[2]) / want[2] < 1e-5, (losses, want)


def _first_half_only(model):
    """Every router's choices folded onto experts 0 and 1: rank 1's experts (2 and 3) get no tokens."""
    for layer in model.model.layers:
        router = layer.mlp.gate
        routed = router.forward
        router.forward = lambda hidden, routed=routed: (lambda out: (*out[:2], out[2] % 2))(routed(hidden))
    return model


def _starved(stage):
    engine, *_ = zerotron.initialize(model=_first_half_only(_build("MixtralForCausalLM")), config=_config(stage))
    return _train(engine)


def test_a_rank_whose_experts_get_no_tokens_does_not_hang_zero3():
    """Rank 1 runs its experts on no rows every step, so they get no gradient there: its ZeRO-3 gathers
    and reductions still match rank 0's, and training matches one process."""
    want, _ = _reference("MixtralForCausalLM", _first_half_only(_build("MixtralForCausalLM")))
    for losses in run_ranks(_starved, 2, 3, timeout=60):
        assert max(abs(a - b) / b for a, b in zip(losses, want)) < 1e-5, (losses, want)


if __name__ == "__main__":
    print(family_sweep.table(run_ranks(sweep, 2, sys.argv[1:] or None, timeout=3000)[0], LAYOUTS))
