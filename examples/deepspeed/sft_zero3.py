"""Supervised fine-tuning of a small chat model under ZeRO-3, in the style of public DeepSpeed
chat fine-tuning applications: a client FusedAdam with weight-decay groups, new special tokens
initialized inside GatheredParameters(enabled=...), prompt tokens masked out of the loss, the loss
averaged over ranks with deepspeed.comm. The model is built from a tiny Llama config with random
weights (nothing is downloaded). Written for DeepSpeed; runs on zerotron unchanged:

    zerotron run --as-deepspeed -n 2 examples/deepspeed/sft_zero3.py \
        --deepspeed_config examples/deepspeed/sft_zero3.json
"""

import argparse

import deepspeed
import deepspeed.comm as dist
import torch
from deepspeed.ops.adam import FusedAdam
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from transformers import AutoModelForCausalLM, LlamaConfig

PROMPT, ANSWER, NEW_TOKENS = 6, 10, 2


def get_optimizer_grouped_parameters(model, weight_decay, no_decay=("bias", "norm.weight")):
    return [
        {
            "params": [
                p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay) and p.requires_grad
            ],
            "weight_decay": weight_decay,
        },
        {
            "params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay) and p.requires_grad],
            "weight_decay": 0.0,
        },
    ]


def chat_samples(n, vocab):
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, vocab - NEW_TOKENS, (n, PROMPT + ANSWER), generator=g)
    ids[:, PROMPT - 1] = vocab - 1  # the new "<assistant>" token ends every prompt
    labels = ids.clone()
    labels[:, :PROMPT] = -100  # only the answer is learned
    return torch.utils.data.TensorDataset(ids, labels)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--weight_decay", type=float, default=0.1)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    deepspeed.init_distributed()
    torch.manual_seed(1234)
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = AutoModelForCausalLM.from_config(config)
    optimizer = FusedAdam(get_optimizer_grouped_parameters(model, args.weight_decay), lr=2e-3, betas=(0.9, 0.95))
    engine, optimizer, loader, _ = deepspeed.initialize(
        args=args, model=model, optimizer=optimizer, training_data=chat_samples(64, config.vocab_size)
    )
    zero3 = engine.zero_optimization_stage() == 3

    embeddings = engine.module.get_input_embeddings().weight
    if zero3 and dist.get_rank() == 0:
        print(
            "embedding released between steps:",
            embeddings.ds_status == ZeroParamStatus.NOT_AVAILABLE,
            "shape",
            tuple(embeddings.ds_shape),
            flush=True,
        )
    with deepspeed.zero.GatheredParameters(embeddings, modifier_rank=0, enabled=zero3):
        if dist.get_rank() == 0:  # the new tokens start at the mean of the others
            with torch.no_grad():
                embeddings[-NEW_TOKENS:] = embeddings[:-NEW_TOKENS].mean(0)

    gas, losses, step = engine.gradient_accumulation_steps(), [], 0
    while step < args.steps:
        for input_ids, labels in loader:
            loss = engine(input_ids=input_ids.to(engine.device), labels=labels.to(engine.device)).loss
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach())
            if len(losses) == gas:
                mean = torch.stack(losses).mean()
                dist.all_reduce(mean, op=dist.ReduceOp.SUM)
                if dist.get_rank() == 0:
                    print(f"step {step} loss {mean.item() / dist.get_world_size():.8f}", flush=True)
                losses, step = [], step + 1
            if step == args.steps:
                break
    dist.barrier()
    if dist.get_rank() == 0:
        print("done", engine.optimizer_name())


if __name__ == "__main__":
    main()
