"""The layout fuzzer (tests/fuzz.py) in CI: a fixed set of seeds, and each bug it found as a named draw."""

import pytest
from fuzz import Draw, Layout, draw, run_draw

CI_SEEDS = range(40)  # about a minute on 2 cores; `python -m tests.fuzz --seeds N` runs more


@pytest.mark.timeout(900)
def test_fixed_seeds_match_single_process_training_or_are_refused():
    failures = []
    for seed in CI_SEEDS:
        verdict, what = run_draw(draw(seed))
        if verdict == "FAIL":
            failures.append(what.splitlines()[0])
    assert not failures, "\n".join(failures)


def _case(model, batch, *layouts, resume_at=2, grouped=False):
    from fuzz import _layers

    first, second = layouts[0], (layouts[1] if len(layouts) > 1 else None)
    return Draw(-1, model, batch, grouped, _layers(*layouts), first, resume_at if second else None, second)


L = Layout
FOUND = {
    # a 4-stage pipeline holds one block per stage: "every_block" found no repeated blocks there (ValueError)
    "checkpointing a stage that holds one block": (
        _case("gpt", 4, L(dp=1, tp=1, pp=4, stage=0, gas=4, micro=1, policy="every_block")),
        "ok",
    ),
    # the pipeline saved the tied embedding as lm_head.weight, the plain model looked for tok_emb.weight
    "a tied embedding saved by a pipeline and loaded by the plain model": (
        _case(
            "gpt_tied", 4, L(dp=1, tp=2, pp=2, stage=0, gas=1, micro=4), L(dp=4, tp=1, pp=1, stage=2, gas=1, micro=1)
        ),
        "ok",
    ),
    # GPT-2's position embedding lives in the module shared by the first and last stage, and only
    # its token embedding was kept equal: the last stage's stale copy went into the checkpoint
    "GPT-2's position embedding inside the module the stages share": (
        _case("gpt2", 4, L(dp=1, tp=1, pp=2, stage=0, gas=2, micro=2)),
        "ok",
    ),
    # ZeRO-1 with offload sent the gradient shards to the host before the tied weights were summed
    "ZeRO-1 offload with weights tied across stages": (
        _case("gpt_tied", 4, L(dp=1, tp=1, pp=2, stage=1, gas=2, micro=2, offload=True)),
        "ok",
    ),
    # Transformers keeps a key/value cache in training; the recomputation saw the forward's keys too
    "selective checkpointing of Transformers layers": (
        _case("llama", 8, L(dp=1, tp=2, pp=1, stage=0, gas=1, micro=8, policy="selective")),
        "ok",
    ),
    # Transformers' plans do not mark sequence-split regions: trained with a 1e-3 loss error
    "sequence parallelism with a Transformers model": (
        _case("gpt2", 8, L(dp=1, tp=2, pp=1, stage=0, gas=1, micro=8, sequence_parallel=True)),
        "refused",
    ),
    # refused with a ValueError at the first step, not a ConfigError at start-up
    "the interleaved schedule with fewer micro-batches than stages": (
        _case("gpt", 4, L(dp=2, tp=1, pp=2, stage=0, gas=1, micro=2, schedule="interleaved", chunks=2)),
        "refused",
    ),
    # zb-h1 recomputes a checkpointed block for B and again for W; selective checkpointing allows one
    # recomputation (torch's RuntimeError at the first W), so it is refused at start-up
    "the zb-h1 schedule with selective checkpointing": (
        _case(
            "gpt2", 4, L(dp=4, tp=1, pp=2, stage=1, gas=1, micro=1, schedule="zb-h1", policy="selective", offload=True)
        ),
        "refused",
    ),
    "the zb-h1 schedule with checkpointed blocks, tensor parallelism and ZeRO-2": (
        _case(
            "llama",
            4,
            L(dp=1, tp=4, pp=2, stage=2, gas=2, micro=2, schedule="zb-h1", policy="every_block"),
            L(dp=4, tp=1, pp=1, stage=0, gas=1, micro=1),
        ),
        "ok",
    ),
    # not findings: sequence splits, drawn by few CI seeds, held here every run. Ulysses x ring with
    # ZeRO-3 and checkpointed blocks, resumed with the ring alone over data ranks with offload
    "Ulysses x ring attention, resumed under another sequence split": (
        _case(
            "gpt",
            4,
            L(dp=1, tp=1, pp=1, stage=3, gas=2, micro=2, policy="every_block", ulysses=2, ring=2),
            L(dp=2, tp=1, pp=1, stage=1, gas=1, micro=2, offload=True, ring=2),
        ),
        "ok",
    ),
    "ring attention with a pipeline": (
        _case("gpt", 4, L(dp=1, tp=1, pp=2, stage=0, gas=2, micro=2, ring=2)),
        "refused",
    ),
}


@pytest.mark.parametrize("name", list(FOUND))
def test_what_the_fuzzer_found(name):
    case, expected = FOUND[name]
    verdict, what = run_draw(case)
    assert verdict == expected, what
