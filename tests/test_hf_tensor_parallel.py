"""Every causal-LM family of the installed Transformers that ships a tensor-parallel plan, under
TP 2 and TP 2 x ZeRO-3 (4 ranks: data 2 x tensor 2), against single-process training: each family
matches (losses within 1e-5 relative, weights within 1e-5) or is refused with a ConfigError before
training. A family that cannot be built tiny or trained by plain PyTorch (a new family whose config
the generic rules of hf_families.py do not fit yet) is no finding about zerotron: it is counted and
named apart ("unbuilt"). `python tests/test_hf_tensor_parallel.py` prints the table."""

import sys

import family_sweep
import pytest
import torch
from distributed import run_ranks
from hf_families import SAMPLES_IN_TRAINING, families, tiny_config
from parity import EPS, hf_loss, reference_training

import zerotron

STEPS, ROWS, SEQ, VOCAB = 3, 4, 16, 128
# Adam divides each step by the gradient's magnitude, which amplifies float rounding towards the
# learning rate where a gradient is ~0 (rarely used embedding rows): a small LR keeps that far
# below the 1e-5 weight tolerance, so the comparison measures the split, not Adam's sensitivity.
LR = 1e-4
LAYOUTS = {"tp2": 0, "tp2_zero3": 3}  # name -> ZeRO stage, both over data 2 x tensor 2


def _batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, VOCAB, (ROWS, SEQ), generator=g) for _ in range(STEPS)]


def _build(cls_name):
    model_cls, cfg = tiny_config(cls_name)
    torch.manual_seed(0)
    model = model_cls(cfg)
    return model.eval() if cfg.model_type in SAMPLES_IN_TRAINING else model


def _reference(cls_name):
    losses, state = reference_training(
        [(x, x) for x in _batches()], model=_build(cls_name), forward=hf_loss, lr=LR, weight_decay=0.0
    )
    return losses, state


def _split(cls_name, stage, ref_losses, ref_weights):
    """('ok' | 'refused' | 'FAIL', detail) on this rank."""
    model = _build(cls_name)
    config = {
        "train_micro_batch_size_per_gpu": ROWS // 2,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**6,
        "tensor_parallel": {"autotp_size": 2},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.95], "eps": EPS, "weight_decay": 0.0}},
    }
    try:
        engine, *_ = zerotron.initialize(model=model, config=config)
    except zerotron.ConfigError as e:
        return "refused", str(e)
    losses = []
    for x in _batches():
        mine = x.chunk(2)[engine.coords.dp]
        losses.append(engine.train_batch(iter([{"input_ids": mine, "labels": mine}])).item())
    weights = zerotron.zero.consolidated_state_dict(engine.module)
    loss_error = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    diffs = {n: (weights[n].float() - w.float()).abs().max().item() for n, w in ref_weights.items() if n in weights}
    missing = sorted(set(ref_weights) - set(weights))
    worst = max(diffs, key=diffs.get)
    detail = f"loss {loss_error:.1e}, weights {diffs[worst]:.1e} ({worst})"
    if missing or loss_error > 1e-5 or diffs[worst] > 1e-5:
        return "FAIL", detail + (f"; missing {missing[:3]}" if missing else "")
    return "ok", detail


def sweep(names=None) -> dict:
    """On each of 4 ranks: every family (or those named), under each layout."""
    return family_sweep.sweep(families(), LAYOUTS, _reference, _split, names)


@pytest.mark.timeout(1500)
def test_every_transformers_family_matches_or_is_refused_under_tensor_parallelism():
    print("\n" + family_sweep.check(run_ranks(sweep, 4, timeout=1400), LAYOUTS))


if __name__ == "__main__":
    print(family_sweep.table(run_ranks(sweep, 4, sys.argv[1:] or None, timeout=3000)[0], LAYOUTS))
