"""What DeepSpeedExamples' BingBertSquad (training/BingBertSquad/nvidia_run_squad_deepspeed.py) needs to run
unchanged on this machine, nothing downloaded: a tiny BERT (a word-piece vocab.txt and a BERT config json, read
through the script's own `--ckpt_type HF --origin_bert_config_file` path, since its default "DS" path hard-codes
BERT-large), SQuAD v1.1 train/dev files of generated paragraphs whose answers are spans, and copies of
deepspeed_bsz24_config.json per variant.

    python tools/public_bingbertsquad.py PATH/training/BingBertSquad WORK
    cd PATH/training/BingBertSquad
    DS_ACCELERATOR=cpu torchrun --standalone --nproc_per_node 2 TOOLS/public_script.py cpu \\
        nvidia_run_squad_deepspeed.py ARGS                                      # real DeepSpeed
    zerotron run -n 2 --as-deepspeed TOOLS/public_script.py cpu nvidia_run_squad_deepspeed.py ARGS      # zerotron

ARGS (run_squad_deepspeed.sh's flags, sizes cut to the tiny model; --no_cuda keeps batches on the CPU, --fp16
and --preln dropped: fp16 does not run on CPU and --preln needs the "DS" path):
    --bert_model WORK/bert --origin_bert_config_file WORK/bert/bert_config.json --ckpt_type HF --do_train
    --do_lower_case --do_predict --predict_batch_size 3 --train_file WORK/squad/train-v1.1.json
    --predict_file WORK/squad/dev-v1.1.json --train_batch_size 12 --learning_rate 3e-5 --num_train_epochs 2
    --max_seq_length 64 --doc_stride 32 --max_query_length 16 --output_dir WORK/out-VARIANT
    --gradient_accumulation_steps 4 --deepspeed --deepspeed_config WORK/VARIANT.json --dropout 0.0
    --seed 12345 --no_cuda

VARIANTs (the shipped config with fp16 off, since DeepSpeed refuses fp16 on CPU, and the learning rate raised
from 3e-5 to 1e-3 so that a wrong update shows in the next steps' losses): fp32, bf16, zero1, zero2, zero3 (fp32
with that ZeRO stage). The output directory must exist (the script writes its predictions into it, creating it
only when it is already there). --deepspeed_transformer_kernel does not run on DeepSpeed 0.19.8 on CPU: the
script reads `DeepSpeedConfig.fp16_enabled`, which DeepSpeed no longer has, and the kernel is CUDA's.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

WORDS = [f"w{i}" for i in range(80)]
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def bert_dir(directory: Path) -> None:
    """vocab.txt and bert_config.json of a 2-layer BERT with hidden 32, no dropout (losses comparable)."""
    directory.mkdir(parents=True, exist_ok=True)
    vocab = SPECIALS + WORDS
    (directory / "vocab.txt").write_text("\n".join(vocab) + "\n")
    config = dict(
        vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        hidden_act="gelu", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, max_position_embeddings=64,
        type_vocab_size=2, initializer_range=0.02,
    )  # fmt: skip
    (directory / "bert_config.json").write_text(json.dumps(config, indent=1))


def squad(questions: int, seed: int) -> dict:
    """SQuAD v1.1: paragraphs of words, each question a few words and its answer the span after the question's
    last word in the paragraph (something a model can learn)."""
    rng = random.Random(seed)
    paragraphs = []
    for p in range(questions // 4):
        words = [rng.choice(WORDS) for _ in range(rng.randrange(20, 40))]
        context = " ".join(words)
        qas = []
        for q in range(4):
            start = rng.randrange(3, len(words) - 3)
            answer = " ".join(words[start : start + rng.randrange(1, 3)])
            offset = len(" ".join(words[:start])) + 1
            question = " ".join(words[start - 3 : start])
            qas.append({"id": f"q{p}-{q}", "question": question, "answers": [{"text": answer, "answer_start": offset}]})
        paragraphs.append({"context": context, "qas": qas})
    return {"version": "1.1", "data": [{"title": "generated", "paragraphs": paragraphs}]}


def configs(shipped: Path, work: Path) -> None:
    base = json.loads(shipped.read_text())
    base.pop("fp16")
    base["optimizer"]["params"]["lr"] = 1e-3
    variants = {
        "fp32": base,
        "bf16": {**base, "bf16": {"enabled": True}},
        "zero1": {**base, "zero_optimization": {"stage": 1}},
        "zero2": {**base, "zero_optimization": {"stage": 2}},
        "zero3": {**base, "zero_optimization": {"stage": 3}},
    }
    for name, config in variants.items():
        (work / f"{name}.json").write_text(json.dumps(config, indent=1))


def prepare(example: Path, work: Path) -> None:
    bert_dir(work / "bert")
    (work / "squad").mkdir(parents=True, exist_ok=True)
    (work / "squad" / "train-v1.1.json").write_text(json.dumps(squad(96, seed=0)))
    (work / "squad" / "dev-v1.1.json").write_text(json.dumps(squad(12, seed=1)))
    configs(example / "deepspeed_bsz24_config.json", work)


if __name__ == "__main__":
    prepare(Path(sys.argv[1]).resolve(), Path(sys.argv[2]).resolve())
