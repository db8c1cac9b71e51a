"""ALST, DeepSpeed's Ulysses for Hugging Face models (issue 30): a Transformers Llama with grouped
key/value heads (4 query, 2 key/value) trained by ALST's loop (tools/alst_script.py: the attention
registered with Transformers, the engine given its mpu, batches through UlyssesSPDataLoaderAdapter,
the sequence ranks' losses weighted by their tokens) matches one process training the same samples
whole: variable lengths padded to a multiple of sp, prompts masked, sp 2 and 4 (4 > the key/value
heads: each is repeated), sp x dp, ZeRO 0-3, SGD with momentum so a wrong gradient scale shows,
AdamW, and the tiled MLP. The all-to-all bytes are the shape-derived count."""

import pytest
from distributed import run_ranks

from tools import alst_script as script


def _train(stage, sp, steps, kind, tiled):
    import zerotron
    from zerotron.compat import sequence_parallel as ulysses_sp

    losses, weights, engine = script.train(zerotron, ulysses_sp, stage, sp, steps, kind, tiled)
    return losses, weights, engine.comm_stats()["all_to_all"]


def _all_to_all_bytes(sp, steps, world, group):
    """Each step's padded length L in sequence group `group`: per layer, q and the output (4 heads)
    and k, v (2 heads, or one repeated head per rank when sp > 2) of L/sp tokens x 8 dims, (sp-1)/sp
    of it sent, fp32, as much again in backward."""
    data = script.samples(steps * world)
    total = 0
    for chosen in script.step_samples(data, world // sp, sp, steps):
        length = data[chosen[group]]["input_ids"].shape[1]
        length += -length % sp
        heads = 2 * script.HEADS + 2 * max(script.KV_HEADS, sp)
        total += 2 * script.LAYERS * (length // sp) * 8 * heads * (sp - 1) // sp * 4
    return total


@pytest.mark.parametrize(
    "world,sp,stage,kind,tiled,steps",
    [
        (2, 2, 0, "sgd", 0, 4),
        (2, 2, 1, "adamw", 0, 10),
        (4, 2, 2, "sgd", 0, 4),
        (4, 4, 3, "sgd", 3, 4),
        (2, 2, 3, "adamw", 2, 10),
    ],
)
def test_alst_trains_like_one_process(world, sp, stage, kind, tiled, steps):
    results = run_ranks(_train, world, stage, sp, steps, kind, tiled, timeout=120)
    want_losses, want_weights = script.reference(script.samples(steps * world), world // sp, sp, steps, kind)
    for rank, (losses, weights, sent) in enumerate(results):
        assert script.max_loss_rel(losses, want_losses) < 1e-6, (losses, want_losses)
        assert script.max_weight_diff(weights, want_weights) < 1e-5
        assert sent == _all_to_all_bytes(sp, steps, world, rank // sp)
