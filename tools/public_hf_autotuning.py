"""Data, tokenizers and models for DeepSpeedExamples' autotuning Hugging Face examples (training/autotuning/hf),
which run Transformers' examples/pytorch/language-modeling/run_clm.py (gpt2*) and text-classification/run_glue.py
(bert, deberta, distilbert) with `deepspeed --autotuning run` and the fixed dsconfigs/ds_config_z{0,1,2,3}.json.
Nothing can be downloaded here, so this writes what the hub would give them. run_clm: a word-level tokenizer and a
local text file; the model is a tiny GPT-2 built from `--model_type gpt2 --config_overrides` (random weights).
run_glue: `--task_name mnli` downloads, so GLUE-like sentence pairs (train.json, validation.json) take its place;
a tiny random sequence classifier per architecture (bert/, distilbert/, deberta/: hidden 32, 2 layers, dropout 0
so the engines' losses compare) with a word tokenizer saved beside it, for `--model_name_or_path DIR`; and the
`accuracy` metric run_glue.py loads even without --do_eval (`evaluate.load("accuracy")` finds ./accuracy/ first).

    python tools/public_hf_autotuning.py OUT_DIR
    cd OUT_DIR && zerotron run -n 2 --as-deepspeed --autotuning run run_clm.py --deepspeed ds_config_tune.json \\
        --model_type gpt2 --config_overrides n_embd=64,n_layer=2,n_head=2,n_positions=128 \\
        --tokenizer_name tok --train_file train.txt --block_size 64 --do_train \\
        --per_device_train_batch_size 1 --learning_rate 2e-5 --max_steps 20 --output_dir out --use_cpu \\
        --save_strategy no --report_to none

(the example's ds_config_tune.json from training/autotuning/hf/dsconfigs, run_clm.py from Transformers), and

    cd OUT_DIR && zerotron run -n 2 --as-deepspeed tools/public_script.py seed run_glue.py \\
        --deepspeed ds_config_z3.json --model_name_or_path bert --train_file train.json \\
        --validation_file validation.json --do_train --max_seq_length 32 --per_device_train_batch_size 8 \\
        --learning_rate 5e-3 --max_steps 20 --output_dir out --save_strategy no --use_cpu --report_to none
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from public_script import WORDS, word_lines, word_tokenizer  # noqa: E402

BERT_SPECIALS = dict(unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")
SEQ = 64  # position embeddings: room for the examples' --max_seq_length at this size
GLUE_MODELS = {  # tiny, every dropout 0 (the engines draw masks from their own random streams)
    "bert": ("BertConfig", dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, classifier_dropout=0.0)),
    "distilbert": ("DistilBertConfig", dict(dim=32, n_layers=2, n_heads=2, hidden_dim=64, dropout=0.0,
                                            attention_dropout=0.0, seq_classif_dropout=0.0)),
    "deberta": ("DebertaV2Config", dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                        intermediate_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                        pooler_dropout=0.0, relative_attention=True, pos_att_type=["p2c", "c2p"],
                                        position_biased_input=False, max_relative_positions=SEQ)),
}  # fmt: skip
ACCURACY = '''"""A local stand-in for the hub's `accuracy` metric: evaluate.load finds ./accuracy/accuracy.py."""

import datasets
import evaluate


class Accuracy(evaluate.Metric):
    def _info(self):
        features = datasets.Features({"predictions": datasets.Value("int64"), "references": datasets.Value("int64")})
        return evaluate.MetricInfo(description="fraction of predictions equal to the references", citation="",
                                   inputs_description="predictions, references: class ids", features=features)

    def _compute(self, predictions, references):
        return {"accuracy": sum(int(p == r) for p, r in zip(predictions, references)) / max(len(references), 1)}
'''


def prepare(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    word_tokenizer({"eos_token": "<|endoftext|>", "unk_token": "<unk>"}, max_length=128).save_pretrained(out / "tok")
    (out / "train.txt").write_text("\n".join(word_lines(2000)) + "\n")
    prepare_glue(out)


def sentence_pairs(n: int, seed: int) -> list[dict]:
    """MNLI-shaped records whose label is a word-set property a tiny classifier learns in a few dozen steps: which
    third of the vocabulary most of the pair's words come from."""
    lines = word_lines(2 * n, seed)
    records = []
    for first, second in zip(lines[0::2], lines[1::2]):
        thirds = [3 * int(w[1:]) // len(WORDS) for w in f"{first} {second}".split()]
        records.append({"sentence1": first, "sentence2": second, "label": max(range(3), key=thirds.count)})
    return records


def glue_tokenizer():
    """A BERT-shaped word tokenizer: [CLS] A [SEP] B [SEP], token type 1 on B, as BERT's own tokenizer encodes pairs."""
    from tokenizers import processors

    tokenizer = word_tokenizer(BERT_SPECIALS, max_length=SEQ)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in ("[CLS]", "[SEP]")}
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=list(ids.items())
    )
    return tokenizer


def prepare_glue(out: Path) -> None:
    import torch
    import transformers

    for split, n, seed in (("train", 512, 0), ("validation", 64, 1)):
        (out / f"{split}.json").write_text("".join(json.dumps(r) + "\n" for r in sentence_pairs(n, seed)))
    (out / "accuracy").mkdir(exist_ok=True)
    (out / "accuracy" / "accuracy.py").write_text(ACCURACY)
    tokenizer = glue_tokenizer()
    for name, (config_class, sizes) in GLUE_MODELS.items():
        config = getattr(transformers, config_class)(
            vocab_size=len(tokenizer), max_position_embeddings=SEQ, pad_token_id=tokenizer.pad_token_id,
            num_labels=3, **sizes
        )  # fmt: skip
        torch.manual_seed(0)
        transformers.AutoModelForSequenceClassification.from_config(config).save_pretrained(out / name)
        tokenizer.save_pretrained(out / name)


if __name__ == "__main__":
    prepare(Path(sys.argv[1]))
