"""The Hugging Face Trainer on zerotron: `TrainingArguments(deepspeed=...)`, zerotron's engine.

    ZEROTRON_AS_DEEPSPEED=1 torchrun --nproc_per_node 2 examples/hf_trainer.py --deepspeed examples/hf_ds_config.json

Transformers and accelerate say `import deepspeed`; with ZEROTRON_AS_DEEPSPEED=1 that module is
zerotron. On CPU pass --use-cpu (accelerate then picks gloo). A tiny random Llama on generated
tokens: nothing is downloaded. Without --deepspeed the same script is plain DDP (the reference).
Writes the Trainer's log history (losses) as JSON to --history when given.

The schedule (constant after one warmup step) and weight decay 0 make DDP and a DeepSpeed config
with `"scheduler": {"type": "WarmupLR", ...}` and an "AdamW" optimizer train the same model: DeepSpeed's
WarmupLR warms up over at least 2 steps (log curve: 0, then the peak), and a config's optimizer decays
every parameter where the Trainer's own skips biases and norms.
"""

import argparse
import json

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MixtralConfig, Trainer, TrainingArguments


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n, seq_len, vocab, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randint(0, vocab, (n, seq_len), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


def _sequence_parallel(sp):
    """ALST as the Transformers docs set it up: each sequence split over `sp` ranks."""
    if sp == 1:
        return None
    from accelerate.utils import ParallelismConfig
    from accelerate.utils.dataclasses import DeepSpeedSequenceParallelConfig

    handler = DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=True, sp_attn_implementation="sdpa")
    return ParallelismConfig(sp_backend="deepspeed", sp_size=sp, sp_handler=handler)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--deepspeed", default=None, help="a DeepSpeed JSON config (path); omit for DDP")
    p.add_argument("--output-dir", default="out/hf_trainer")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--save-steps", type=int, default=0)
    p.add_argument("--resume", default=None, help="checkpoint dir, or 'last'")
    p.add_argument("--eval-only", action="store_true")
    p.add_argument("--eval-on-start", action="store_true", help="evaluate once as training starts (eval_on_start)")
    p.add_argument("--gradient-checkpointing", action="store_true")
    p.add_argument("--init-from", default=None, help="from_pretrained this directory instead of from_config")
    p.add_argument("--use-cpu", action="store_true")
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--history", default=None)
    p.add_argument(
        "--model-first",
        action="store_true",
        help="build the model before TrainingArguments: under ZeRO-3 then not inside zero.Init",
    )
    p.add_argument("--compile-backend", default=None, help="torch.compile the model (engine.compile under DeepSpeed)")
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--save-model", default=None)
    p.add_argument("--sp", type=int, default=1, help="Ulysses over N ranks (accelerate's ParallelismConfig, ALST)")
    p.add_argument("--moe", action="store_true", help="a Mixtral (4 experts, top-2) instead of a Llama")
    a = p.parse_args()

    torch.manual_seed(0)
    sizes = dict(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        attn_implementation="sdpa",
    )
    config = MixtralConfig(**sizes, num_local_experts=4, num_experts_per_tok=2) if a.moe else LlamaConfig(**sizes)
    model = AutoModelForCausalLM.from_config(config) if a.model_first else None
    args = TrainingArguments(
        output_dir=a.output_dir,
        deepspeed=a.deepspeed,
        use_cpu=a.use_cpu,
        max_steps=a.steps,
        per_device_train_batch_size=2,
        per_device_eval_batch_size=2,
        gradient_accumulation_steps=a.grad_accum,
        learning_rate=1e-3,
        warmup_steps=2,
        weight_decay=0.0,
        max_grad_norm=a.max_grad_norm,
        torch_compile=a.compile_backend is not None,
        torch_compile_backend=a.compile_backend,
        logging_steps=1,
        report_to=[],
        seed=0,
        data_seed=0,
        dataloader_num_workers=0,
        save_strategy="steps" if a.save_steps else "no",
        save_steps=a.save_steps or 500,
        eval_strategy="steps" if a.eval_on_start else "no",
        eval_steps=10_000,
        eval_on_start=a.eval_on_start,
        gradient_checkpointing=a.gradient_checkpointing,
        disable_tqdm=True,
        remove_unused_columns=False,
        parallelism_config=_sequence_parallel(a.sp),
    )
    if a.init_from:  # after TrainingArguments(deepspeed=<ZeRO-3>): each rank loads its pieces inside zero.Init
        model = AutoModelForCausalLM.from_pretrained(a.init_from)
    elif model is None:  # inside deepspeed.zero.Init under ZeRO-3: Transformers re-initializes the weights
        model = AutoModelForCausalLM.from_config(config)  # on rank 0, so they differ from a plain build's
    trainer = Trainer(
        model=model, args=args, train_dataset=Tokens(64, 16, 128), eval_dataset=Tokens(16, 16, 128, seed=1)
    )
    out = {}
    if a.eval_only:
        out["eval"] = trainer.evaluate()
    else:
        resume = a.resume
        if resume == "last":
            resume = True
        trainer.train(resume_from_checkpoint=resume)
        out["eval"] = trainer.evaluate()
        if a.save_model:
            trainer.save_model(a.save_model)
    out["history"] = trainer.state.log_history
    engine = trainer.model_wrapped
    out["engine"] = f"{type(engine).__module__}.{type(engine).__name__}"
    if hasattr(engine, "zero_optimization_stage"):
        out["zero_stage"] = engine.zero_optimization_stage()
        out["tp"] = engine.config.get("tensor_parallel", {}).get("autotp_size", 1)
        out["host_bytes"] = engine.memory_report().get("host", 0)  # model states kept in host memory (offload)
        out["sp"] = engine.topology.sp
    out["gradient_checkpointing"] = trainer.model.is_gradient_checkpointing
    if a.history and trainer.is_world_process_zero():
        with open(a.history, "w") as f:
            json.dump(out, f)
    if trainer.is_world_process_zero():
        losses = [h["loss"] for h in out["history"] if "loss" in h]
        print("losses:", losses, "eval:", out["eval"].get("eval_loss"))


if __name__ == "__main__":
    main()
    if torch.distributed.is_initialized():  # a clean teardown: gloo may abort at interpreter exit otherwise
        torch.distributed.destroy_process_group()
