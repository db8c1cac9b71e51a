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

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from public_script import word_lines, word_tokenizer  # noqa: E402


def prepare(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    word_tokenizer({"eos_token": "<|endoftext|>", "unk_token": "<unk>"}, max_length=128).save_pretrained(out / "tok")
    (out / "train.txt").write_text("\n".join(word_lines(2000)) + "\n")


if __name__ == "__main__":
    prepare(Path(sys.argv[1]))
