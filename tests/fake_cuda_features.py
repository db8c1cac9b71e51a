"""Every feature's training step, for the fake-CUDA pass (tests/test_fake_cuda.py): each `Feature` trains a
few steps on its ranks, yielding each step's loss, and carries the host syncs a step of it may cost on a GPU,
with the reason. The same steps run on the CPU for the losses to compare with.

Budgets count what makes the host wait for the device in a step after the first (tools/fake_cuda): reading a
device value, a blocking copy, an operation whose output size depends on device values. Every feature pays
one for the step's agreement (zerotron/engine/step.py: overflow, bad input and preemption, one host read)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from parity import ds_config, global_batches, make_model, micro_batches

import zerotron
from zerotron.parallelize import to_pipeline

STEPS = 3


@dataclass
class Feature:
    name: str
    world: int
    budget: int  # host syncs per step (after the first), on every rank
    why: str
    steps: Callable  # () -> an iterator of per-step loss tensors, on each rank


def _engine_steps(model, config, gas=2, batch_rows=None, seq_split=1):
    engine, *_ = zerotron.initialize(model=model, config=config)
    dp = engine.topology.dp
    for b in global_batches(STEPS, batch_rows or gas * dp):
        yield engine.train_batch(iter(micro_batches(b, engine.coords.dp, dp, gas)))


def _gpt(**overrides):
    return make_model(n_kv_head=4, **overrides)


def zero(stage, **zero_extra):
    def steps():
        config = ds_config(1, 2, zero_optimization={"stage": stage, **zero_extra})
        return _engine_steps(_gpt(), config)

    return steps


def offload(stage, params):
    def steps():
        zero_section = {"stage": stage, "offload_optimizer": {"device": "cpu", "pin_memory": True}}
        if params:
            zero_section["offload_param"] = {"device": "cpu", "pin_memory": True}
        config = ds_config(1, 2, zero_optimization=zero_section, bf16={"enabled": True})
        return _engine_steps(_gpt(), config)

    return steps


def tensor_parallel():
    config = ds_config(1, 2, tensor_parallel={"autotp_size": 2})
    return _engine_steps(_gpt(), config, batch_rows=2)


def pipeline(schedule, chunks=1):
    def steps():
        module = to_pipeline(_gpt(n_layer=4), 2, partition_method="type:_PipeBlock", num_virtual_stages=chunks)
        config = ds_config(1, 4, pipeline={"schedule": schedule})
        return _engine_steps(module, config, gas=4)

    return steps


def context(sp, cp, dtype=torch.float32, kv_heads=4):
    """The reference GPT with Ulysses (sp) and ring attention (cp) over the sequence: each rank's tokens of
    16 (ring: 4 chunks of 4, so a rank's queries are 8, not a multiple of 32). In bf16 ring attention takes
    CUDA's flash kernel, in fp32 its memory-efficient one."""

    def steps():
        from zerotron.long_context.layout import SequenceSplit

        config = ds_config(1, 1, sequence_parallel_size=sp, zerotron={"context_parallel_size": cp})
        if dtype == torch.bfloat16:
            config["bf16"] = {"enabled": True}
        engine, *_ = zerotron.initialize(model=make_model(n_kv_head=kv_heads), config=config)
        split = SequenceSplit.of(engine.topology, dist.get_rank())
        for x, y in global_batches(STEPS, 1):
            device = engine.device
            loss = engine(split.take(x).to(device, non_blocking=True), split.take(y).to(device, non_blocking=True))
            engine.backward(loss)
            engine.step()
            yield loss

    return steps


def deepspeed_moe_layer():
    """DeepSpeed's MoE layer (tests/moe_model.py's TinyMoE, top-2, dropless) with its experts over 2 ranks."""
    from moe_model import TinyMoE, batches

    rank = dist.get_rank()
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_clipping": 0.0,
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
        "zero_allow_untested_optimizer": True,
    }
    engine, *_ = zerotron.initialize(model=TinyMoE(2, rank, 2), config=config)
    for b in batches(STEPS, 2):
        mine = b[rank : rank + 1].to(engine.device, non_blocking=True)
        loss = engine(mine[:, :-1], mine[:, 1:])
        engine.backward(loss)
        engine.step()
        yield loss


def moe_gpt(ep: int, odd: bool = False):
    """The reference MoE GPT (4 experts, top 2) in bf16 through torch's grouped matrix multiply, its experts over
    `ep` ranks. `odd`: each layer's norm gets a 3-element parameter (a learned scale, as some families have) and
    ZeRO-1's one bucket holds every parameter: after one, a parameter laid end to end would start 6 bytes past a
    16-byte boundary (without expert parallelism the experts share the bucket)."""

    def steps():
        model = _gpt(n_experts=4, top_k=2, expert_ffn=32, aux_loss_coef=0.0)
        zero = {"stage": 1}
        if odd:
            for layer in model.layers:
                layer.attn_norm.register_parameter("odd", torch.nn.Parameter(torch.ones(3)))
            zero["reduce_bucket_size"] = 10**8
        extra = {"expert_parallel": {"enabled": True, "autoep_size": ep}} if ep > 1 else {}
        config = ds_config(1, 2, zero_optimization=zero, bf16={"enabled": True}, **extra)
        return _engine_steps(model, config)

    return steps


def autoep():
    """A Transformers MoE family (Qwen3-MoE, tiny and random) with DeepSpeed's AutoEP config over 2 ranks."""
    from hf_families import tiny_config

    model_cls, cfg = tiny_config("Qwen3MoeForCausalLM")
    torch.manual_seed(0)
    model = model_cls(cfg)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": 2},
        "bf16": {"enabled": True},  # (in fp32 CUDA's grouped matrix multiply falls back to a loop that syncs)
        "optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}},
        "zero_allow_untested_optimizer": True,
        "expert_parallel": {"enabled": True, "autoep_size": 2},
    }
    engine, *_ = zerotron.initialize(model=model, config=config)
    g = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        x = torch.randint(3, 128, (4, 16), generator=g).chunk(2)[engine.coords.dp]
        yield engine.train_batch(iter([{"input_ids": x, "labels": x}]))


def alst():
    """ALST on a Transformers Llama (4 query, 2 key/value heads; variable lengths padded to sp) through
    DeepSpeed's Ulysses API (tools/alst_script.py: the attention registered with Transformers, the batches
    through UlyssesSPDataLoaderAdapter), sp 2, ZeRO-2."""
    from tools import alst_script
    from zerotron.compat import sequence_parallel as ulysses_sp

    for _, loss in alst_script.micro_steps(zerotron, ulysses_sp, 2, 2, STEPS, "adamw"):
        yield loss


def checkpointing():
    config = ds_config(1, 2, zero_optimization={"stage": 2}, zerotron={"checkpoint_policy": "every_block"})
    return _engine_steps(_gpt(), config)


AGREEMENT = "the step's agreement"
OFFLOADED = (
    "the agreement; the host waits for the gradients it steps on (offload.py gradients_arrived), reads the NaN/Inf "
    "check of their norms (FusedHostStep.inspect) and brings the clipping factor to the host (FusedHostStep.apply)"
)
RECEIVED = "the agreement; the shape header of each batch a stage receives, one per flow into it"
ROUTED = "the agreement; each MoE layer's one host read of its routes' counts, per layer and micro-batch"
FEATURES = [
    Feature("zero0", 2, 1, AGREEMENT, zero(0)),
    Feature("zero1", 2, 1, AGREEMENT, zero(1)),
    Feature("zero2", 2, 1, AGREEMENT, zero(2)),
    Feature("zero3", 2, 1, AGREEMENT, zero(3)),
    Feature("offload_optimizer", 2, 4, OFFLOADED, offload(2, params=False)),
    Feature("offload_param", 2, 4, OFFLOADED, offload(3, params=True)),
    Feature("tensor_parallel", 2, 1, AGREEMENT, tensor_parallel),
    Feature("pipeline_gpipe", 2, 2, RECEIVED, pipeline("gpipe")),
    Feature("pipeline_1f1b", 2, 2, RECEIVED, pipeline("1f1b")),
    Feature(
        "pipeline_interleaved", 2, 3, RECEIVED + " (the last stage's two chunks: two flows)", pipeline("interleaved", 2)
    ),
    Feature("pipeline_zb_h1", 2, 2, RECEIVED, pipeline("zb-h1")),
    Feature("ulysses", 2, 1, AGREEMENT, context(2, 1)),
    Feature("ring", 2, 1, AGREEMENT + " (fp32: CUDA's memory-efficient kernel)", context(1, 2)),
    Feature("ring_bf16_grouped_kv", 2, 1, AGREEMENT + " (bf16: CUDA's flash kernel)", context(1, 2, torch.bfloat16, 2)),
    Feature(
        "alst_transformers",
        2,
        9,
        "the agreement; every sp-th micro-step, DeepSpeed's UlyssesSPDataLoaderAdapter exchanging the next batches "
        "as Python objects over the sequence group (on NCCL: each pickled to the device, sizes and bytes read back)",
        alst,
    ),  # fmt: skip
    Feature("activation_checkpointing", 2, 1, AGREEMENT, checkpointing),
    Feature("deepspeed_moe_layer", 2, 2, ROUTED + " (1 x 1)", deepspeed_moe_layer),
    Feature("moe_gpt_grouped", 2, 5, ROUTED + " (2 x 2)", moe_gpt(ep=2)),
    Feature("moe_gpt_grouped_odd_parameters", 2, 5, ROUTED + " (2 x 2)", moe_gpt(ep=1, odd=True)),
    Feature("autoep_transformers", 2, 3, ROUTED + " (2 x 1)", autoep),
]
BY_NAME = {f.name: f for f in FEATURES}


def run(name: str) -> tuple[list[float], list[list[str]], list[str]]:
    """`name`'s steps on this rank: each step's loss, the host syncs of each step (on a fake GPU) and the
    operations without a meta kernel (checked by the plain device rule only)."""
    from tools.fake_cuda import FakeCuda

    session = FakeCuda.current()
    losses, syncs = [], []
    for loss in BY_NAME[name].steps():
        losses.append(loss.detach())
        if session is not None:
            syncs.append([str(s) for s in session.take_syncs()])
    values = [float(loss) for loss in losses]
    return values, syncs, sorted(session.unchecked) if session is not None else []
