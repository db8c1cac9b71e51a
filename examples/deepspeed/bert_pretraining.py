"""Masked-language-model pre-training of a small BERT-style encoder, with checkpoints and resume,
in the style of DeepSpeed's BERT pre-training tutorial (random tokens; nothing is downloaded).
Written for DeepSpeed; runs on zerotron unchanged:

    zerotron run --as-deepspeed -n 2 examples/deepspeed/bert_pretraining.py \
        --deepspeed_config examples/deepspeed/bert_pretraining.json --output_dir /tmp/bert --steps 4
    # ... later, the same command with --resume continues from the newest checkpoint
"""

import argparse

import deepspeed
import torch
import torch.nn as nn
from deepspeed.runtime.utils import set_random_seed
from deepspeed.utils import log_dist, logger

VOCAB, MASK, SEQ = 128, 1, 16


class BertForMaskedLM(nn.Module):
    def __init__(self, d=32, layers=2, heads=2):
        super().__init__()
        self.embeddings = nn.Embedding(VOCAB, d)
        self.position = nn.Embedding(SEQ, d)
        block = nn.TransformerEncoderLayer(d, heads, 2 * d, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.cls = nn.Linear(d, VOCAB)

    def forward(self, input_ids, labels):
        h = self.embeddings(input_ids) + self.position(torch.arange(input_ids.shape[1], device=input_ids.device))
        logits = self.cls(self.encoder(h))
        return nn.functional.cross_entropy(logits.view(-1, VOCAB), labels.view(-1), ignore_index=-100)


def masked_corpus(n=192):
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(2, VOCAB, (n, SEQ), generator=g)
    chosen = torch.rand(n, SEQ, generator=g) < 0.15
    labels = torch.where(chosen, tokens, torch.full_like(tokens, -100))
    return torch.utils.data.TensorDataset(tokens.masked_fill(chosen, MASK), labels)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--save_every", type=int, default=2)
    parser.add_argument("--resume", action="store_true")
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    deepspeed.init_distributed(dist_backend=None)
    set_random_seed(42)
    model = BertForMaskedLM()
    engine, optimizer, loader, scheduler = deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters(), training_data=masked_corpus()
    )
    step = 0
    if args.resume:
        path, client_state = engine.load_checkpoint(args.output_dir)
        step = client_state["step"]
        log_dist(f"resumed from {path} at step {step}", ranks=[0])

    engine.train()
    gas, losses = engine.gradient_accumulation_steps(), []
    while step < args.steps:
        for input_ids, labels in loader:
            loss = engine(input_ids.to(engine.device), labels.to(engine.device))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
            if len(losses) < gas:  # not yet a whole global batch
                continue
            log_dist(f"step {step} loss {sum(losses) / gas:.8f} lr {scheduler.get_last_lr()[0]:.3e}", ranks=[0])
            losses, step = [], step + 1
            if step % args.save_every == 0:
                engine.save_checkpoint(args.output_dir, tag=f"step{step}", client_state={"step": step})
            if step == args.steps:
                break
    logger.info("pre-training finished")


if __name__ == "__main__":
    main()
