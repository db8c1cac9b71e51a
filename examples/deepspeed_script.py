"""A DeepSpeed training script, unchanged except for its first import.

zerotron run -n 2 examples/deepspeed_script.py --deepspeed --deepspeed_config examples/ds_config.json
"""

import argparse

import torch

import zerotron as deepspeed
from zerotron.data import TokenWindows, load_corpus
from zerotron.models.gpt import GPT, config_for


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    deepspeed.init_distributed()
    torch.manual_seed(0)
    model = GPT(config_for("tiny", max_seq_len=64))
    train, _ = load_corpus(max_bytes=400_000)
    engine, optimizer, loader, scheduler = deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters(), training_data=TokenWindows(train, 64)
    )

    step, first = 0, None
    while step < args.steps * engine.gradient_accumulation_steps():
        for x, y in loader:
            loss = engine(x.to(engine.device), y.to(engine.device))
            engine.backward(loss)
            engine.step()
            first = first if first is not None else loss.item()
            step += 1
            if step >= args.steps * engine.gradient_accumulation_steps():
                break
    if engine.global_rank == 0:
        print(f"done: {engine.global_steps} steps, lr {engine.get_lr()[0]:.2e}, loss {first:.3f} -> {loss.item():.3f}")


if __name__ == "__main__":
    main()
