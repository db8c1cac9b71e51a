"""An accelerate training loop as users write it (tests/test_hf_accelerate.py runs it):
DeepSpeedPlugin for ZeRO 2/3 (argument: the stage) or plain DDP ("ddp"); save_state, two more
steps, load_state and the same two steps again; get_state_dict and save_pretrained."""
import json
import sys

import torch
from accelerate import Accelerator, PartialState
from accelerate.utils import DeepSpeedPlugin
from transformers import AutoModelForCausalLM, LlamaConfig

mode, out_dir = sys.argv[1], sys.argv[2]
PartialState(backend="gloo", cpu=True)  # on CPU accelerate needs gloo; on GPUs nothing is needed
plugin = None if mode == "ddp" else DeepSpeedPlugin(zero_stage=int(mode), gradient_accumulation_steps=1,
                                                    gradient_clipping=1.0)
accelerator = Accelerator(cpu=True, deepspeed_plugin=plugin)
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64,
                                                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
data = torch.randint(0, 96, (32, 12), generator=torch.Generator().manual_seed(1))
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=2)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)


def train(batches):
    losses = []
    for (x,) in batches:
        loss = model(input_ids=x, labels=x).loss
        accelerator.backward(loss)
        if plugin is None:
            accelerator.clip_grad_norm_(model.parameters(), 1.0)
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
accelerator.unwrap_model(model).save_pretrained(f"{out_dir}/model", state_dict=state,
                                                is_main_process=accelerator.is_main_process,
                                                save_function=accelerator.save)
if accelerator.is_main_process:
    print("RESULT " + json.dumps({"first": first, "after": after, "again": again}), flush=True)
torch.distributed.destroy_process_group()  # a clean teardown: gloo may abort at interpreter exit otherwise
