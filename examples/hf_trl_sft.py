"""TRL's SFTTrainer on zerotron's ZeRO-3 ("ds"), ZeRO-3 with each sequence split over 2 ranks by
Ulysses ("sp": accelerate's ParallelismConfig(sp_backend="deepspeed"), ALST), ZeRO-3 with a MoE
model's experts split over 2 ranks ("ep": DeepSpeed's AutoEP section) or plain DDP ("ddp"):

    torchrun --nproc_per_node 2 examples/hf_trl_sft.py ds MODEL_DIR OUT

MODEL_DIR is a saved Transformers causal LM (tests/test_zero3_hf.py saves a tiny random Llama);
the script turns the alias on itself (zerotron.as_deepspeed()) before TRL imports deepspeed. The
tokenizer is a word-level one built here over the model's vocabulary: nothing is downloaded.
Writes the logged losses to OUT/<mode>.json.
"""

import json
import sys

import zerotron

mode, model_dir, out = sys.argv[1], sys.argv[2], sys.argv[3]
if mode in ("ds", "sp", "ep"):
    zerotron.as_deepspeed()  # before transformers/accelerate/trl say `import deepspeed`
import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from tokenizers import Tokenizer, models  # noqa: E402
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast  # noqa: E402
from trl import SFTConfig, SFTTrainer  # noqa: E402

ds = (
    {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "steps_per_print": 10**6,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        **({"expert_parallel": {"enabled": True, "autoep_size": 2}} if mode == "ep" else {}),
    }
    if mode in ("ds", "sp", "ep")
    else None
)
parallelism = None
if mode == "sp":
    from accelerate.utils import ParallelismConfig
    from accelerate.utils.dataclasses import DeepSpeedSequenceParallelConfig

    handler = DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=True, sp_attn_implementation="sdpa")
    parallelism = ParallelismConfig(sp_backend="deepspeed", sp_size=2, sp_handler=handler)
args = SFTConfig(
    output_dir=out + "/run",
    deepspeed=ds,
    use_cpu=True,
    max_steps=3,
    per_device_train_batch_size=2,
    learning_rate=1e-3,
    lr_scheduler_type="constant",
    weight_decay=0.0,
    max_grad_norm=1.0,
    logging_steps=1,
    report_to=[],
    seed=0,
    data_seed=0,
    disable_tqdm=True,
    save_strategy="no",
    bf16=False,
    fp16=False,
    gradient_checkpointing=False,
    max_length=16,
    packing=False,
    dataloader_num_workers=0,
    parallelism_config=parallelism,
)
model = AutoModelForCausalLM.from_pretrained(
    model_dir, attn_implementation="sdpa"
)  # under ZeRO-3: inside deepspeed.zero.Init
partitioned = all(p.numel() == 0 and getattr(p, "ds_tensor", None) is not None for p in model.parameters())
vocab = {f"t{i}": i for i in range(256)}
tok = PreTrainedTokenizerFast(
    tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t1")), pad_token="t0", eos_token="t2", unk_token="t1"
)
g = torch.Generator().manual_seed(0)
data = Dataset.from_dict({"input_ids": torch.randint(3, 256, (32, 16), generator=g).tolist()})
trainer = SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tok)
trainer.train()
losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
engine = type(trainer.model_wrapped).__module__
if trainer.is_world_process_zero():
    with open(out + f"/{mode}.json", "w") as f:
        json.dump({"losses": losses, "engine": engine, "partitioned": partitioned}, f)
torch.distributed.destroy_process_group()  # a clean teardown: gloo may abort at interpreter exit otherwise
