"""A tiny Llama for DeepSpeedExamples' Hugging Face fine-tuning scripts that load a hub model by name
(training/DeepSpeed-SuperOffload/finetune_zero3.py, training/DeepSpeed-ZenFlow/finetuning/finetune_llama.py):
nothing can be downloaded here, so this writes a 2-layer random Llama (hidden 32, bf16, as the scripts load it)
and a word-level tokenizer with Llama's special tokens into one local directory, passed as `--model_name`.
The Alpaca data they load (`load_dataset("tatsu-lab/alpaca")`) is tools/public_script.py's `alpaca` stand-in.

    python tools/public_hf_finetune.py MODEL_DIR
    cd PATH/training/DeepSpeed-SuperOffload
    torchrun --standalone --nproc_per_node 2 TOOLS/public_script.py alpaca finetune_zero3.py ARGS   # real DeepSpeed
    zerotron run -n 2 --as-deepspeed TOOLS/public_script.py alpaca finetune_zero3.py ARGS           # zerotron

ARGS (finetune_llama-8b_1gpu.sh's, sizes cut): --deepspeed_config CONFIG --model_name MODEL_DIR --lr 1e-5
--batch_size 4 --output_dir OUT --max_length 32 --attn_implementation eager --bench_steps 8 --warmup_steps 2
--activation_checkpointing, where CONFIG is the JSON the shell script writes for its MODE (zerooffload,
superoffload) with BATCH_SIZE=4. Both scripts import wandb (for logging they leave off by default): the wandb
package must be importable.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from public_script import word_tokenizer  # noqa: E402


def prepare(model_dir: Path, seed: int = 0) -> None:
    import torch
    import transformers

    roles = dict(bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    tokenizer = word_tokenizer(roles, max_length=64)
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False,
    )  # fmt: skip
    model_dir.mkdir(parents=True, exist_ok=True)
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)


if __name__ == "__main__":
    prepare(Path(sys.argv[1]).resolve())
