"""Run accelerate's own ALST test script (accelerate/test_utils/scripts/external_deps/
test_ds_alst_ulysses_sp.py, as installed) unchanged but for what this machine lacks: its hub model
becomes a tiny random Llama built from a config, its tokenizer (loaded, never used) None, and the
process group gloo on CPU. Under `accelerate launch --use_deepspeed` it trains with real DeepSpeed,
or with zerotron when ZEROTRON_AS_DEEPSPEED=1:

    accelerate launch --use_deepspeed --zero_stage 3 --num_processes 2 tools/public_alst_script.py
"""

import runpy
from pathlib import Path

import torch


def tiny_llama(*args, **kwargs):
    """The script's hub model, as a tiny random Llama (seed 0)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        attn_implementation="sdpa",
    )
    return transformers.LlamaForCausalLM(config)


def main():
    import accelerate
    from accelerate import PartialState

    PartialState(backend="gloo", cpu=True)  # before the script's Accelerator: on CPU DeepSpeed stays on this way
    import deepspeed
    import transformers

    deepspeed.init_distributed(dist_backend="gloo")  # DeepSpeed's comm learns of the group accelerate made
    transformers.AutoModelForCausalLM.from_pretrained = tiny_llama
    transformers.AutoTokenizer.from_pretrained = lambda *args, **kwargs: None
    script = Path(accelerate.__file__).parent / "test_utils/scripts/external_deps/test_ds_alst_ulysses_sp.py"
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main()
