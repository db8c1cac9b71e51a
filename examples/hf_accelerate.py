"""An accelerate training loop as users write it (tests/test_hf_accelerate.py runs it):

    ZEROTRON_AS_DEEPSPEED=1 accelerate launch --use_deepspeed --zero_stage 2 --num_processes 2 \
        examples/hf_accelerate.py launch out

The same
code runs on plain DDP ("ddp"), with a DeepSpeedPlugin for ZeRO 2/3 (argument: the stage), or
under `accelerate launch --use_deepspeed` ("launch": the plugin comes from the launcher's
environment). The model is loaded with from_pretrained from a saved directory (the third argument)
after the Accelerator exists, as users do (without it, a tiny random Llama is built from its config):
under ZeRO-3 inside zero.Init, each rank loading only its
pieces. (A model built with from_config there would start from other random values than a plain
build, in DeepSpeed as here: Transformers skips the constructors' init and re-initializes on rank 0.)
save_state, two more steps, load_state and the same two steps again; get_state_dict
and save_pretrained."""

import json
import sys

import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import DeepSpeedPlugin
from transformers import AutoModelForCausalLM, LlamaConfig

mode, out_dir = sys.argv[1], sys.argv[2]
model_dir = sys.argv[3] if len(sys.argv) > 3 else None
# On CPU accelerate needs gloo, and only a state made first with cpu=True keeps DeepSpeed on: passing
# Accelerator(cpu=True) turns DeepSpeed off (accelerate's rule). On GPUs nothing is needed.
PartialState(backend="gloo", cpu=True)
plugin = (
    None
    if mode in ("ddp", "launch")
    else DeepSpeedPlugin(
        zero_stage=int(mode), gradient_accumulation_steps=1, gradient_clipping=1.0, zero3_save_16bit_model=True
    )
)
accelerator = Accelerator(deepspeed_plugin=plugin)
if model_dir is not None:
    model = AutoModelForCausalLM.from_pretrained(model_dir)
else:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        LlamaConfig(
            vocab_size=96,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    )
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
data = torch.randint(0, 96, (32, 12), generator=torch.Generator().manual_seed(1))
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=2)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
norms = []


def train(batches):
    losses = []
    for (x,) in batches:
        loss = model(input_ids=x, labels=x).loss
        accelerator.backward(loss)
        # DDP: clips and returns the norm; DeepSpeed: clipped inside its step, returns that step's norm
        norms.append(float(accelerator.clip_grad_norm_(model.parameters(), 1.0)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(accelerator.gather(loss.detach()[None]).mean().item())
    return losses


batches = list(loader)
first = train(batches[:3])
accelerator.save_state(f"{out_dir}/state")
after = train(batches[3:5])
accelerator.load_state(f"{out_dir}/state")
again = train(batches[3:5])
state = accelerator.get_state_dict(model)
if accelerator.is_main_process:  # (save_pretrained empties the dict it is given)
    torch.save({k: v.float().clone() for k, v in state.items()}, f"{out_dir}/state_dict.pt")
accelerator.unwrap_model(model).save_pretrained(
    f"{out_dir}/model", state_dict=state, is_main_process=accelerator.is_main_process, save_function=accelerator.save
)
if accelerator.is_main_process:
    engine = f"{type(model).__module__}.{type(model).__name__}"
    stage = model.zero_optimization_stage() if hasattr(model, "zero_optimization_stage") else None
    print(
        "RESULT "
        + json.dumps(
            {
                "first": first,
                "after": after,
                "again": again,
                "norms": norms,
                "engine": engine,
                "stage": stage,
                "type": str(accelerator.distributed_type),
            }
        ),
        flush=True,
    )
torch.distributed.destroy_process_group()  # a clean teardown: gloo may abort at interpreter exit otherwise
