"""What DeepSpeed-Chat's training scripts (DeepSpeedExamples' applications/DeepSpeed-Chat/training/step*/main.py)
need to run unchanged on this machine, nothing downloaded: a tiny random OPT with a word-level tokenizer in
a local directory (its config.json names that directory, so the script's `load_hf_tokenizer` loads it),
and the script's own "local/jsonfile" dataset (DeepSpeed-Chat's data/train.json and data/eval.json of
prompt / chosen / rejected records made of the tokenizer's words).

    python tools/public_dschat.py PATH/applications/DeepSpeed-Chat MODEL_DIR
    ZEROTRON_AS_DEEPSPEED=1 torchrun --nproc_per_node 2 PATH/.../step1_supervised_finetuning/main.py \\
        --data_path local/jsonfile --model_name_or_path MODEL_DIR --dtype bf16 --zero_stage 2 \\
        --per_device_train_batch_size 2 --max_seq_len 32 --print_loss --deepspeed --output_dir OUT

Step 3 (PPO) loads its critic and reward model from a reward model's pytorch_model.bin: run step 2 on
MODEL_DIR first and pass its --output_dir as --critic_model_name_or_path (the actor is MODEL_DIR);
step 3 also imports torch.utils.tensorboard, so the tensorboard package must be installed.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

WORDS = [f"w{i}" for i in range(120)]


def prepare(dschat: Path, model_dir: Path, samples: int = 64, seed: int = 0) -> None:
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GPT2TokenizerFast, OPTConfig, OPTForCausalLM

    specials = ["<pad>", "</s>", "<unk>"]
    vocab = {w: i for i, w in enumerate(specials + WORDS + ["Human:", "Assistant:"])}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # (OPT's own tokenizer class: the script's save_hf_format calls save_vocabulary, which it has)
    tokenizer = GPT2TokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="</s>", unk_token="<unk>")
    torch.manual_seed(seed)
    config = OPTConfig(
        vocab_size=len(vocab), hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, layerdrop=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=1,
    )  # fmt: skip
    model_dir.mkdir(parents=True, exist_ok=True)
    OPTForCausalLM(config).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    saved = json.loads((model_dir / "config.json").read_text())
    saved["_name_or_path"] = str(model_dir)  # where the script's load_hf_tokenizer looks
    (model_dir / "config.json").write_text(json.dumps(saved, indent=1))

    rng = random.Random(seed)
    sentence = lambda n: " ".join(rng.choice(WORDS) for _ in range(n))  # noqa: E731
    records = [
        {"prompt": f"Human: {sentence(6)} Assistant:", "chosen": sentence(8), "rejected": sentence(8)}
        for _ in range(samples)
    ]
    (dschat / "data").mkdir(exist_ok=True)
    (dschat / "data" / "train.json").write_text("\n".join(json.dumps(r) for r in records[: samples * 3 // 4]))
    (dschat / "data" / "eval.json").write_text("\n".join(json.dumps(r) for r in records[samples * 3 // 4 :]))


if __name__ == "__main__":
    prepare(Path(sys.argv[1]).resolve(), Path(sys.argv[2]).resolve())
