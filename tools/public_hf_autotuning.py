"""Data and tokenizer for DeepSpeedExamples' autotuning Hugging Face examples (training/autotuning/hf), which
run Transformers' examples/pytorch/language-modeling/run_clm.py (gpt2*) and text-classification/run_glue.py
(bert, deberta, distilbert) with `deepspeed --autotuning run`. Nothing can be downloaded here, so this writes
what the hub would give them: a word-level tokenizer and a local text file; the model is a tiny GPT-2 built
from `--model_type gpt2 --config_overrides` (random weights).

    python tools/public_hf_autotuning.py OUT_DIR
    cd OUT_DIR && zerotron run -n 2 --as-deepspeed --autotuning run run_clm.py --deepspeed ds_config_tune.json \\
        --model_type gpt2 --config_overrides n_embd=64,n_layer=2,n_head=2,n_positions=128 \\
        --tokenizer_name tok --train_file train.txt --block_size 64 --do_train \\
        --per_device_train_batch_size 1 --learning_rate 2e-5 --max_steps 20 --output_dir out --use_cpu \\
        --save_strategy no --report_to none

(the example's ds_config_tune.json from training/autotuning/hf/dsconfigs, run_clm.py from Transformers).
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

WORDS = [f"w{i}" for i in range(200)]


def prepare(out: Path, lines: int = 2000, seed: int = 0) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<|endoftext|>", "<unk>", *WORDS])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|endoftext|>", unk_token="<unk>")
    tokenizer.model_max_length = 128
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out / "tok")
    rng = random.Random(seed)
    # a learnable text: each word mostly followed by the next one
    text = []
    for _ in range(lines):
        w = rng.randrange(len(WORDS))
        line = []
        for _ in range(rng.randrange(8, 24)):
            line.append(WORDS[w])
            w = (w + 1) % len(WORDS) if rng.random() < 0.8 else rng.randrange(len(WORDS))
        text.append(" ".join(line))
    (out / "train.txt").write_text("\n".join(text) + "\n")


if __name__ == "__main__":
    prepare(Path(sys.argv[1]))
