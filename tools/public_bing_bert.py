"""What DeepSpeedExamples' BERT pre-training (training/bing_bert/deepspeed_train.py) needs to run unchanged on this
machine, nothing downloaded: a word-piece vocab.txt (tools/public_bingbertsquad.py's) named by a tiny --cf model
config (2 layers, hidden 32, no dropout, the script's own mixed_seq_datasets / mixed_seq_training layout for
sequence length 64), NVIDIA-format HDF5 shards of generated masked-LM samples (one per rank, read through the
script's --use_nvidia_dataset path; the h5py package must be importable), and DeepSpeed configs made from
deepspeed_bsz64k_lamb_config_seq128.json.

    python tools/public_bing_bert.py PATH/training/bing_bert WORK
    cd PATH/training/bing_bert
    torchrun --standalone --nproc_per_node 2 TOOLS/public_script.py cpu deepspeed_train.py ARGS      # real DeepSpeed
    zerotron run -n 2 --as-deepspeed TOOLS/public_script.py cpu deepspeed_train.py ARGS              # zerotron

ARGS (ds_train_bert_nvidia_data_bsz64k_seq128.sh's, sizes cut): --cf WORK/bert_tiny.json --max_seq_length 64
--max_predictions_per_seq 10 --output_dir WORK/out-VARIANT --deepspeed --print_steps 1 --lr_schedule EE
--lr_offset 0.0 --job_name VARIANT --deepspeed_config WORK/VARIANT.json --data_path_prefix WORK
--use_nvidia_dataset --max_steps 6 --seed 42, without --deepspeed_transformer_kernel (DeepSpeed's CUDA layer).

VARIANTs (the shipped config with its batch cut to 16 = 4 per rank x 2 ranks x 2 accumulation): `shipped` (Lamb,
fp16 with dynamic loss scaling, its sparse_attention section), `adam_zero2` (Adam at ZeRO-2). The script runs only
with fp16 (without it, its train loop reads `lr_this_step` before assigning it). DeepSpeed 0.19.8 runs neither here:
it refuses fp16 on CPU and the `sparse_attention` key (removed), its Lamb is a CUDA kernel (FusedLambBuilder has no
CPU build), and with any other optimizer the script reads `deepspeed.runtime.config.ONEBIT_LAMB_OPTIMIZER`, which
0.19.8 no longer has.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from public_bingbertsquad import SPECIALS, WORDS, bert_dir  # noqa: E402

SEQ, PREDICTIONS = 64, 10


def model_config(work: Path) -> dict:
    bert = json.loads((work / "bert" / "bert_config.json").read_text())
    training = dict(
        num_epochs=1, warmup_proportion=0.06, learning_rate=1e-3, num_workers=0, async_worker=True, decay_rate=0.9,
        decay_step=250, total_training_steps=100,
    )  # fmt: skip
    return {
        "name": "bing_bert_tiny",
        "bert_token_file": str(work / "bert"),
        "bert_model_file": str(work / "bert"),
        "bert_model_config": {"vocab_size_or_config_json_file": bert.pop("vocab_size"), **bert},
        "data": {"flags": {"pretrain_dataset": True, "pretrain_type": "wiki_bc"},
                 "mixed_seq_datasets": {str(SEQ): {"pretrain_dataset": "data64"}}},
        "mixed_seq_training": {str(SEQ): training},
        "validation": {"path": "validation_set/"},
    }  # fmt: skip


def shard(path: Path, samples: int, seed: int) -> None:
    """One NVIDIA-format shard: two segments of words, a few of them masked (ids and positions recorded)."""
    import h5py
    import numpy as np

    rng = random.Random(seed)
    ids = np.zeros((samples, SEQ), np.int32)
    mask, segments = np.zeros_like(ids), np.zeros_like(ids)
    positions, labels = np.zeros((samples, PREDICTIONS), np.int32), np.zeros((samples, PREDICTIONS), np.int32)
    next_sentence = np.zeros(samples, np.int32)
    cls, sep, masked = (SPECIALS.index(t) for t in ("[CLS]", "[SEP]", "[MASK]"))
    for i in range(samples):
        a, b = rng.randrange(10, 25), rng.randrange(10, 25)
        words = [len(SPECIALS) + rng.randrange(len(WORDS)) for _ in range(a + b)]
        tokens = [cls, *words[:a], sep, *words[a:], sep]
        ids[i, : len(tokens)], mask[i, : len(tokens)], segments[i, a + 2 : len(tokens)] = tokens, 1, 1
        where = sorted(rng.sample([p for p, t in enumerate(tokens) if t not in (cls, sep)], PREDICTIONS))
        positions[i], labels[i] = where, [tokens[p] for p in where]
        ids[i, where] = masked
        next_sentence[i] = rng.randrange(2)
    with h5py.File(path, "w") as f:
        for key, value in (("input_ids", ids), ("input_mask", mask), ("segment_ids", segments),
                           ("masked_lm_positions", positions), ("masked_lm_ids", labels),
                           ("next_sentence_labels", next_sentence)):  # fmt: skip
            f.create_dataset(key, data=value)


def configs(shipped: Path, work: Path) -> None:
    base = json.loads(shipped.read_text())
    base.update(train_batch_size=16, train_micro_batch_size_per_gpu=4, steps_per_print=1)
    adam = {**base, "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "weight_decay": 0.01}}}
    variants = {"shipped": base, "adam_zero2": {**adam, "zero_optimization": {"stage": 2}}}
    for name, config in variants.items():
        (work / f"{name}.json").write_text(json.dumps(config, indent=1))


def prepare(example: Path, work: Path) -> None:
    bert_dir(work / "bert")
    (work / "bert_tiny.json").write_text(json.dumps(model_config(work), indent=1))
    (work / "data64").mkdir(parents=True, exist_ok=True)
    for rank in range(2):
        shard(work / "data64" / f"training_{rank}.hdf5", samples=64, seed=rank)
    configs(example / "deepspeed_bsz64k_lamb_config_seq128.json", work)


if __name__ == "__main__":
    prepare(Path(sys.argv[1]).resolve(), Path(sys.argv[2]).resolve())
