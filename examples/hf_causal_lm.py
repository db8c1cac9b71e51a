"""Fine-tune a (tiny, random) Hugging Face Llama on the embedded corpus with a DeepSpeed config.

    zerotron run -n 2 examples/hf_causal_lm.py --deepspeed_config examples/hf_ds_config.json

The config's "auto" values are filled from the training arguments below, as the Transformers
Trainer fills them (zerotron.hf.resolve_config). A real fine-tune would load weights with
`AutoModelForCausalLM.from_pretrained(path)` or `zerotron.hf.load_hf_weights(engine, path)`
(each rank reads only its slices); nothing is downloaded here.
"""

import argparse
from types import SimpleNamespace

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import zerotron
from zerotron.data import corpus_loaders


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--save", default=None, help="write the trained model here as a Hugging Face directory")
    parser = zerotron.add_config_arguments(parser)
    args = parser.parse_args()

    zerotron.init_distributed()
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=args.seq_len,
    )
    model = AutoModelForCausalLM.from_config(config)
    training = SimpleNamespace(
        per_device_train_batch_size=args.micro_batch,
        gradient_accumulation_steps=1,
        learning_rate=args.lr,
        adam_beta1=0.9,
        adam_beta2=0.95,
        adam_epsilon=1e-8,
        weight_decay=0.1,
        max_grad_norm=1.0,
        fp16=False,
        bf16=False,
        warmup_steps=3,
        max_steps=args.steps,
    )
    ds_config = zerotron.hf.resolve_config(args.deepspeed_config, training, model)
    engine, *_ = zerotron.initialize(model=model, config=ds_config)

    loader, _ = corpus_loaders(args.seq_len, args.micro_batch, engine.topology.dp, engine.coords.dp, max_bytes=400_000)
    data = iter(loader)
    first = None
    for step in range(args.steps):
        x, _ = next(data)  # Transformers shifts the labels inside its loss
        x = x.to(engine.device)
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        first = loss.item() if first is None else first
    prompt = torch.tensor([list(b"def ")])
    sample = zerotron.hf.generate(engine, prompt, max_new_tokens=24, do_sample=False)
    if args.save:
        zerotron.hf.save_hf_pretrained(engine, args.save)
    if engine.global_rank == 0:
        print(
            f"done: {engine.global_steps} steps, ZeRO-{engine.zero_optimization_stage()}, "
            f"loss {first:.3f} -> {loss.item():.3f}"
        )
        print("sample:", bytes(sample[0].tolist()).decode("utf-8", errors="replace"))


if __name__ == "__main__":
    main()
