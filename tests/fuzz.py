"""A seeded layout fuzzer: random model x layout x way of handing things in x resume, each draw held
against plain single-process PyTorch.

    python -m tests.fuzz --seeds 50            # draws 0..49
    python -m tests.fuzz --seeds 10 --start 200 --verbose

A draw picks a model (the reference GPT, its pipeline form with the embedding tied across the first
and last stage, its mixture-of-experts form, or a tiny Transformers family), a layout (data x tensor x
pipeline x sequence <= 8 ranks, experts over data ranks, ZeRO 0-3, accumulation 1-4, schedule,
activation checkpointing, optimizer offload, Megatron's sequence parallelism, Ulysses and ring
attention splitting each sequence; fp32), how the parameters and optimizer reach `initialize`, and a
save at a random step resumed under a second, different random layout with the same global batch.
Every draw must match single-process training (each step's loss within 1e-5 relative, final weights
within 1e-5) or be refused with a ConfigError before its first step; anything else is a finding.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from distributed import RankError, run_ranks  # noqa: E402
from parity import EPS, LR, global_batches, hf_loss, micro_batches, param_groups, reference_training  # noqa: E402

from zerotron.parallelize import to_pipeline

STEPS = 4
MODELS = ("gpt", "gpt_tied", "moe", "llama", "qwen2", "gpt2")  # moe: the reference GPT with 4 experts, top-2
# How parameters and the optimizer reach initialize; with two parameter groups (decay / no decay,
# as the Hugging Face Trainer builds them) or one.
HANDED_IN = {False: ("nothing", "generator", "list", "client", "callable"), True: ("groups", "client", "callable")}
POLICIES = ("none", "every_block", "every_k", "selective")


@dataclasses.dataclass(frozen=True)
class Layout:
    dp: int
    tp: int
    pp: int
    stage: int
    gas: int
    micro: int
    schedule: str = "1f1b"
    chunks: int = 1
    policy: str = "none"
    offload: bool = False
    sequence_parallel: bool = False
    handed_in: str = "nothing"
    ulysses: int = 1  # sequence_parallel_size
    ring: int = 1  # zerotron.context_parallel_size
    ep: int = 1  # expert_parallel.autoep_size (the moe model's experts over ep of the data ranks)

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.ulysses * self.ring


@dataclasses.dataclass(frozen=True)
class Draw:
    seed: int
    model: str
    batch: int  # sequences per step, the same under both layouts
    grouped: bool  # two optimizer groups (decay / no decay) or one
    layers: int  # blocks: at least one per pipeline part of either layout
    first: Layout
    resume_at: int | None  # None: no resume; else the step the second layout starts from
    second: Layout | None

    def describe(self) -> str:
        text = f"seed {self.seed}: {self.model} x{self.layers}, batch {self.batch}, {_short(self.first)}"
        return text + (f"; resumed at step {self.resume_at} under {_short(self.second)}" if self.second else "")


def _short(lay: Layout) -> str:
    extra = [f"zero{lay.stage}", f"gas{lay.gas}", f"mb{lay.micro}", lay.handed_in]
    if lay.pp > 1:
        extra.append(lay.schedule + (f"x{lay.chunks}" if lay.chunks > 1 else ""))
    extra += [
        x
        for x, on in (
            (lay.policy, lay.policy != "none"),
            ("offload", lay.offload),
            ("sp", lay.sequence_parallel),
            (f"ulysses{lay.ulysses}", lay.ulysses > 1),
            (f"ring{lay.ring}", lay.ring > 1),
            (f"ep{lay.ep}", lay.ep > 1),
        )
        if on
    ]
    return f"dp{lay.dp} tp{lay.tp} pp{lay.pp} " + " ".join(extra)


def _layout(rng: random.Random, model: str, batch: int, grouped: bool, max_world: int) -> Layout:
    while True:
        tp = rng.choice([1, 1, 2, 2, 4])
        pp = rng.choice([1, 1, 2, 2, 4]) if model != "qwen2" else 1  # qwen2: no pipeline form to test here
        dp = rng.choice([d for d in (1, 2, 4) if batch % d == 0])
        if dp * tp * pp <= max_world:
            break
    gas = rng.choice([g for g in (1, 2, 3, 4) if (batch // dp) % g == 0])
    schedule = rng.choice(["gpipe", "1f1b", "interleaved", "zb-h1"]) if pp > 1 else "1f1b"
    # Mostly what is supported, sometimes what must be refused (ZeRO-3 or sequence parallelism with
    # pipelines, sequence parallelism with Transformers models).
    stage = rng.choice([0, 1, 2, 3] if pp == 1 or rng.random() < 0.1 else [0, 1, 2])
    sp_supported = pp == 1 and model in ("gpt", "gpt_tied", "moe")
    sequence_parallel = tp > 1 and rng.random() < (0.4 if sp_supported else 0.05)
    # Each sequence split over Ulysses x ring ranks: the GPT without tensor or pipeline parallelism
    # (its adapter applies both); now and then where it must be refused (with tp or pp).
    # Transformers models need the sequence-wide loss of tests/test_alst.py and test_ring.py, not this loop.
    ulysses = ring = 1
    room = max_world // (dp * tp * pp)
    splits = [(u, r) for u in (1, 2) for r in (1, 2, 4) if 1 < u * r <= room and not _is_hf(model)]
    if splits and rng.random() < (0.35 if sp_supported and tp == 1 else 0.05):
        ulysses, ring = rng.choice(splits)
    # Experts over data ranks (4 experts); now and then with tensor, pipeline or sequence splits, refused
    ep = 1
    if model == "moe" and tp == pp == ulysses * ring == 1:
        ep = rng.choice([e for e in (1, 2, 2, 4) if dp % e == 0])
    elif model == "moe" and rng.random() < 0.1:
        ep = 2
    return Layout(
        dp=dp,
        tp=tp,
        pp=pp,
        stage=stage,
        gas=gas,
        micro=batch // (dp * gas),
        schedule=schedule,
        chunks=2 if schedule == "interleaved" else 1,
        policy=rng.choice(POLICIES),
        offload=stage > 0 and rng.random() < 0.25,
        sequence_parallel=sequence_parallel,
        handed_in=rng.choice(HANDED_IN[grouped]),
        ulysses=ulysses,
        ring=ring,
        ep=ep,
    )


def draw(seed: int, max_world: int = 8) -> Draw:
    rng = random.Random(seed)
    model = rng.choice(MODELS)
    batch = rng.choice([4, 8])
    grouped = rng.random() < 0.3
    first = _layout(rng, model, batch, grouped, max_world)
    if rng.random() < 0.25:
        return Draw(seed, model, batch, grouped, _layers(first), first, None, None)
    second = first
    while second == first:
        second = _layout(rng, model, batch, grouped, max_world)
    return Draw(seed, model, batch, grouped, _layers(first, second), first, rng.randint(1, STEPS - 1), second)


def _layers(*layouts: Layout) -> int:
    return max([4] + [lay.pp * lay.chunks for lay in layouts])


# ---- models ---------------------------------------------------------------------------------------
def build_model(name: str, layers: int = 4):
    """The draw's model, seeded: every rank and the reference build the same weights."""
    torch.manual_seed(0)
    if name in ("gpt", "gpt_tied", "moe"):
        from zerotron.models.gpt import GPT, config_for

        experts = dict(n_experts=4, top_k=2, expert_ffn=64, aux_loss_coef=0.0) if name == "moe" else {}
        tied = name == "gpt_tied"
        return GPT(config_for("tiny", max_seq_len=16, n_layer=layers, n_kv_head=4, tie_embeddings=tied, **experts))
    from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, Qwen2Config

    if name == "gpt2":
        cfg = GPT2Config(
            vocab_size=256,
            n_embd=64,
            n_layer=layers,
            n_head=4,
            n_positions=64,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
        )
    else:
        cfg = {"llama": LlamaConfig, "qwen2": Qwen2Config}[name](
            vocab_size=256,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=64,
            tie_word_embeddings=name == "qwen2",
        )
    cfg._attn_implementation = "sdpa"
    return AutoModelForCausalLM.from_config(cfg)


def _is_hf(name: str) -> bool:
    return name not in ("gpt", "gpt_tied", "moe")


def reference(d: Draw):
    """Plain PyTorch on one process: per-step losses and final weights by parameter name."""
    return reference_training(
        global_batches(STEPS, d.batch),
        model=build_model(d.model, d.layers),
        groups=param_groups if d.grouped else None,
        forward=hf_loss if _is_hf(d.model) else None,
    )


# ---- one layout on its ranks ----------------------------------------------------------------------
def _config(lay: Layout) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": lay.micro,
        "gradient_accumulation_steps": lay.gas,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**6,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.95], "eps": EPS, "weight_decay": 0.1}},
        "tensor_parallel": {"autotp_size": lay.tp},
        "zero_optimization": {"stage": lay.stage, "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 5000},
        "zerotron": {
            "checkpoint_policy": lay.policy,
            "sequence_parallel": lay.sequence_parallel,
            "context_parallel_size": lay.ring,
        },
        "sequence_parallel_size": lay.ulysses,
        "pipeline": {"schedule": lay.schedule},
    }
    if lay.offload:
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    if lay.ep > 1:
        config["expert_parallel"] = {"enabled": True, "autoep_size": lay.ep}
    return config


def _initialize(name: str, layers: int, lay: Layout, grouped: bool):
    import zerotron

    model = build_model(name, layers)
    if lay.pp > 1:
        model = (
            to_pipeline(model, lay.pp, num_virtual_stages=lay.chunks)
            if _is_hf(name)
            else to_pipeline(model, lay.pp, partition_method="type:_PipeBlock", num_virtual_stages=lay.chunks)
        )
    config, kwargs = _config(lay), {}
    adamw = lambda params: torch.optim.AdamW(params, lr=LR, betas=(0.9, 0.95), eps=EPS, weight_decay=0.1)  # noqa: E731
    groups = param_groups(model) if grouped else list(model.parameters())
    if lay.handed_in == "generator":
        kwargs["model_parameters"] = model.parameters()
    elif lay.handed_in in ("list", "groups"):
        kwargs["model_parameters"] = groups
    elif lay.handed_in == "client":
        config.pop("optimizer")
        kwargs["optimizer"] = adamw(groups)
    elif lay.handed_in == "callable":
        config.pop("optimizer")
        kwargs.update(optimizer=adamw, model_parameters=groups)
    engine, *_ = zerotron.initialize(model=model, config=config, **kwargs)
    return engine


def run_layout(
    name: str, layers: int, batch: int, lay: Layout, grouped: bool, directory: str, load: bool, steps: range
):
    """On each rank: build, (load), train `steps`, save. Returns ("refused", message) or the losses."""
    import zerotron

    try:
        engine = _initialize(name, layers, lay, grouped)
    except zerotron.ConfigError as e:
        return "refused", str(e)
    if load:
        engine.load_checkpoint(directory)
    from zerotron.long_context.layout import SequenceSplit

    split = SequenceSplit.of(engine.topology, torch.distributed.get_rank())
    losses = []
    for b in global_batches(STEPS, batch)[steps.start : steps.stop]:
        x_y = [(split.take(x), split.take(y)) for x, y in micro_batches(b, engine.coords.dp, lay.dp, lay.gas)]
        feed = (
            [{"input_ids": x, "labels": x} for x, _ in x_y]
            if _is_hf(name) and lay.pp == 1
            else [(x, x) for x, _ in x_y]
            if _is_hf(name)
            else x_y
        )
        losses.append(engine.train_batch(iter(feed)).item())
    engine.save_checkpoint(directory)
    return "ran", losses


def run_draw(d: Draw, timeout: float = 180) -> tuple[str, str]:
    """("ok" | "refused" | "FAIL", what): the draw trained against the reference."""
    ref_losses, ref_weights = reference(d)
    with tempfile.TemporaryDirectory() as tmp:
        legs = [(d.first, False, range(0, d.resume_at or STEPS))]
        if d.second is not None:
            legs.append((d.second, True, range(d.resume_at, STEPS)))
        losses = []
        for layout, load, steps in legs:
            try:
                results = run_ranks(
                    run_layout,
                    layout.world,
                    d.model,
                    d.layers,
                    d.batch,
                    layout,
                    d.grouped,
                    tmp,
                    load,
                    steps,
                    timeout=timeout,
                )
            except RankError as e:
                return "FAIL", f"{d.describe()}: {_first_error(str(e))}\n{e}"
            kinds = {r[0] for r in results}
            if kinds == {"refused"}:
                return "refused", f"{d.describe()}: {results[0][1]}"
            if kinds != {"ran"}:
                return "FAIL", f"{d.describe()}: some ranks refused, others ran: {results}"
            losses += results[0][1]
        weights = _saved_weights(tmp)
    problems = []
    for step, (a, b) in enumerate(zip(losses, ref_losses)):
        if abs(a - b) > 1e-5 * abs(b):
            problems.append(f"step {step}: loss {a:.7f} vs {b:.7f} (rel {abs(a - b) / abs(b):.1e})")
    missing = sorted(set(ref_weights) - set(weights) - _tied_aliases(d.model))
    if missing:
        problems.append(f"parameters missing from the checkpoint: {missing[:4]}")
    worst = max(
        ((n, (weights[n] - ref_weights[n]).abs().max().item()) for n in weights if n in ref_weights),
        key=lambda t: t[1],
        default=("", 0.0),
    )
    if worst[1] > 1e-5:
        problems.append(f"weights differ by {worst[1]:.1e} ({worst[0]})")
    return ("FAIL", f"{d.describe()}: " + "; ".join(problems)) if problems else ("ok", d.describe())


def _first_error(text: str) -> str:
    """The exception line of the first rank's traceback in a RankError."""
    lines = [line for line in text.splitlines() if line and not line.startswith((" ", "---", "Traceback"))]
    return lines[0][:300] if lines else text[:300]


def _tied_aliases(name: str) -> set[str]:
    return {"lm_head.weight"} if name in ("gpt_tied", "qwen2", "gpt2") else set()


def _saved_weights(directory: str) -> dict[str, torch.Tensor]:
    """The full fp32 weights the last leg saved, by parameter name (topology-free)."""
    from pathlib import Path

    from zerotron.checkpoint.files import read_meta
    from zerotron.checkpoint.load import SavedPieces, resolve_tag

    root = Path(directory)
    path = root / resolve_tag(root, None)
    saved = SavedPieces(path, read_meta(path))
    return {n: saved.full(n, "master") for n in saved.by_name}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=20, help="how many draws")
    parser.add_argument("--start", type=int, default=0, help="first seed")
    parser.add_argument("--max-world", type=int, default=8)
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    counts, failures, start = {"ok": 0, "refused": 0, "FAIL": 0}, [], time.monotonic()
    for seed in range(args.start, args.start + args.seeds):
        verdict, what = run_draw(draw(seed, args.max_world))
        counts[verdict] += 1
        if verdict == "FAIL":
            failures.append(what)
        if args.verbose or verdict == "FAIL":
            print(f"{verdict:8s} {what if args.verbose else what.splitlines()[0]}", flush=True)
    print(
        f"{args.seeds} draws in {time.monotonic() - start:.0f} s: {counts['ok']} matched, "
        f"{counts['refused']} refused, {counts['FAIL']} failed"
    )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
