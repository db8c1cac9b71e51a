"""ALST's training loop on a Hugging Face Llama (DeepSpeed's Ulysses tutorial and accelerate's
`test_ds_alst_ulysses_sp.py`, adapted for data and size): `UlyssesSPAttentionHF.register_with_transformers`,
the engine built with its mpu, `UlyssesSPDataLoaderAdapter` over the loader, the model's loss on
`shift_labels`, the sequence ranks' losses combined weighted by their valid tokens (the Trainer's
recipe), with a tiny grouped-query Llama (4 query heads, 2 key/value heads) on variable-length
sequences whose prompts are masked (-100). `reference` trains the same samples in one process.
tests/test_alst.py runs it under zerotron; tools/alst_compare.py under zerotron and real DeepSpeed."""

from __future__ import annotations

import math
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F

VOCAB, HIDDEN, HEADS, KV_HEADS, LAYERS = 128, 32, 4, 2, 2
warnings.filterwarnings("ignore", message=".*torch.distributed.nn.functional.all_reduce is deprecated")


def build_model(attn="sdpa"):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=64,
        attn_implementation=attn,
    )
    return LlamaForCausalLM(config)


UNEVEN = (24, 31, 20, 33, 28, 25, 32, 22)  # some not a multiple of 2 or 4: zerotron pads them
EVEN = (24, 24, 20, 20, 36, 36, 16, 16)  # DeepSpeed: lengths sp divides, the same on the ranks it gathers (gloo)


def samples(n: int, lengths=UNEVEN):
    """n [1, L] samples of varying length with their positions 0..L-1 (what the ALST tutorial's
    collator adds); each one's first 5 tokens are a prompt with labels -100."""
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        ids = torch.randint(3, VOCAB, (1, lengths[i % len(lengths)]), generator=g)
        labels = ids.clone()
        labels[:, :5] = -100
        out.append({"input_ids": ids, "position_ids": torch.arange(ids.shape[1])[None], "labels": labels})
    return out


def optimizer_config(kind: str) -> dict:
    if kind == "sgd":
        return {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}
    return {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.0}}


def _torch_optimizer(kind, params):
    cls = torch.optim.SGD if kind == "sgd" else torch.optim.AdamW
    return cls(params, **optimizer_config(kind)["params"])


def step_samples(data, dp: int, sp: int, steps: int) -> list[list[int]]:
    """Which samples each optimizer step trains on when `data` is dealt round-robin to dp x sp ranks
    (sequence groups of consecutive ranks) and each group's adapter shares its ranks' samples in
    rank order: step i*sp + m holds, from each group g, sample (g*sp + m) + i*dp*sp."""
    world = dp * sp
    return [[(g * sp + t % sp) + (t // sp) * world for g in range(dp)] for t in range(steps)]


def reference(data, dp: int, sp: int, steps: int, kind: str, gas: int = 1):
    """One process: each micro-step the mean over its samples of each sample's token-mean loss;
    the optimizer steps after every `gas` micro-steps, on their mean."""
    data = [{k: v for k, v in d.items() if k != "position_ids"} for d in data]
    model = build_model()
    opt = _torch_optimizer(kind, model.parameters())
    losses = []
    for micro, chosen in enumerate(step_samples(data, dp, sp, steps)):
        loss = sum(model(**data[i]).loss for i in chosen) / len(chosen)
        (loss / gas).backward()
        if (micro + 1) % gas == 0:
            opt.step()
            opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def tiled_mlp_forward(TiledMLP, shards: int):
    """ALST's LlamaMLP patch: the MLP run over `shards` slices of the sequence."""

    def mlp(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    def forward(self, x):
        return TiledMLP.apply(mlp, self, x, shards, [p for p in self.parameters()])

    return forward


class TiledLossLM(torch.nn.Module):
    """A script's own wrapper around a Transformers causal LM, as ALST's recipes write it: the summed
    cross-entropy from the hidden states, one slice of the vocabulary-wide logits at a time
    (`tiled_loss`: DeepSpeed's or zerotron's TiledFusedLogitsLoss)."""

    def __init__(self, lm, tiled_loss, shards: int):
        super().__init__()
        self.lm, self.tiled_loss, self.shards = lm, tiled_loss, shards

    @staticmethod
    def _loss(head, hidden, labels):
        return F.cross_entropy(head(hidden).float(), labels, ignore_index=-100, reduction="sum")

    def forward(self, input_ids, position_ids, shift_labels):
        hidden = self.lm.model(input_ids=input_ids, position_ids=position_ids)[0]
        head = self.lm.lm_head
        return self.tiled_loss.apply(self._loss, head, hidden, shift_labels, None, self.shards, [head.weight], "sum")


def sequence_loss(logits, shift_labels, group):
    """The Trainer's recipe: the sequence ranks' mean losses weighted by their valid tokens, on every
    rank. Written as sums (a rank whose slice is all prompt has no mean), all-reduced: torch's
    differentiable all_gather fails on gloo groups that do not start at rank 0."""
    total = F.cross_entropy(logits.float().flatten(0, 1), shift_labels.flatten(), ignore_index=-100, reduction="sum")
    count = (shift_labels != -100).sum().to(total.dtype)
    total = torch.distributed.nn.functional.all_reduce(total, group=group)
    count = torch.distributed.nn.functional.all_reduce(count, group=group)
    return total / count.clamp(min=1)


def train(
    deepspeed, ulysses_sp, stage: int, sp: int, steps: int, kind: str, tiled_shards: int = 0, lengths=UNEVEN, gas=1
):
    """The ALST loop on this rank (deepspeed: DeepSpeed or zerotron; ulysses_sp: its
    `runtime.sequence_parallel.ulysses_sp`), `steps` micro-steps with the optimizer stepping every
    `gas` of them. Returns the per-step losses, the full weights and the
    engine (its comm_stats() under zerotron)."""
    losses, world = [], dist.get_world_size()
    for engine, loss in micro_steps(deepspeed, ulysses_sp, stage, sp, steps, kind, tiled_shards, lengths, gas):
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    return losses, _full_weights(engine, deepspeed, stage), engine


def micro_steps(
    deepspeed, ulysses_sp, stage: int, sp: int, steps: int, kind: str, tiled_shards: int = 0, lengths=UNEVEN, gas=1
):
    """`train`'s loop, one micro-step at a time: yields (engine, this rank's loss) after each."""
    world = dist.get_world_size()
    model = build_model()
    if tiled_shards:
        from transformers.models.llama import modeling_llama

        modeling_llama.LlamaMLP.forward = tiled_mlp_forward(ulysses_sp.TiledMLP, tiled_shards)
    mpu = ulysses_sp.UlyssesSPAttentionHF.register_with_transformers(
        model_name_or_path=model,
        core_attn_implementation="sdpa",
        sequence_parallel_size=sp,
        micro_batch_size=1,
        seq_length_is_variable=True,
    )
    dp = world // sp
    config = {
        "train_batch_size": dp * gas,
        "train_micro_batch_size_per_gpu": 1,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": stage},
        "optimizer": optimizer_config(kind),
        "zero_allow_untested_optimizer": True,
    }
    engine, *_ = deepspeed.initialize(model=model, config=config, mpu=mpu, model_parameters=model.parameters())
    rank = dist.get_rank()
    data = samples(steps * world, lengths)
    mine = [data[i] for i in range(rank, len(data), world)]
    loader = ulysses_sp.UlyssesSPDataLoaderAdapter(
        torch.utils.data.DataLoader(mine, batch_size=None),
        sp_rank=mpu.get_sequence_parallel_rank(),
        sp_group=mpu.get_sequence_parallel_group(),
        sp_world_size=mpu.get_sequence_parallel_world_size(),
        device=engine.device,
    )
    group = mpu.get_sequence_parallel_group()
    for step, batch in enumerate(loader):
        if step == steps:
            break
        out = engine(input_ids=batch["input_ids"], position_ids=batch["position_ids"])
        loss = sequence_loss(out.logits, batch["shift_labels"], group)
        engine.backward(loss)
        engine.step()
        yield engine, loss


def _full_weights(engine, deepspeed, stage):
    params = dict(engine.module.named_parameters())
    if stage == 3:
        with deepspeed.zero.GatheredParameters(list(params.values())):
            return {k: v.detach().clone() for k, v in params.items()}
    return {k: v.detach().clone() for k, v in params.items()}


def max_weight_diff(a: dict, b: dict) -> float:
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def max_loss_rel(a, b) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b)) if a else math.inf
