"""An image classifier trained the way DeepSpeed's CIFAR-10 tutorial does it, on random images
(nothing is downloaded). Written for DeepSpeed; runs on zerotron unchanged:

    zerotron run --as-deepspeed -n 2 examples/deepspeed/image_classifier.py \
        --deepspeed_config examples/deepspeed/image_classifier.json
"""

import argparse

import deepspeed
import deepspeed.comm as dist
import torch
import torch.nn as nn
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer


def add_argument():
    parser = argparse.ArgumentParser(description="image classifier")
    parser.add_argument("--local_rank", type=int, default=-1, help="local rank passed from distributed launcher")
    parser.add_argument("--steps", type=int, default=4)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 6, 5)
        self.pool = nn.MaxPool2d(2, 2)
        self.conv2 = nn.Conv2d(6, 16, 5)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, 84)
        self.fc3 = nn.Linear(84, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


def create_moe_param_groups(model):
    parameters = {"params": [p for p in model.parameters()], "name": "parameters"}
    return split_params_into_different_moe_groups_for_optimizer(parameters)


def main():
    args = add_argument()
    deepspeed.init_distributed()
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1)
    trainset = torch.utils.data.TensorDataset(
        torch.randn(256, 3, 32, 32, generator=generator), torch.randint(0, 10, (256,), generator=generator)
    )
    net = Net()
    model_engine, optimizer, trainloader, _ = deepspeed.initialize(
        args=args, model=net, model_parameters=create_moe_param_groups(net), training_data=trainset
    )

    local_device = get_accelerator().device_name(model_engine.local_rank)
    target_dtype = (
        torch.bfloat16 if model_engine.bfloat16_enabled() else torch.half if model_engine.fp16_enabled() else None
    )
    criterion = nn.CrossEntropyLoss()
    gas, losses, step = model_engine.gradient_accumulation_steps(), [], 0
    while step < args.steps:
        for data in trainloader:
            inputs, labels = data[0].to(local_device), data[1].to(local_device)
            if target_dtype is not None:
                inputs = inputs.to(target_dtype)
            loss = criterion(model_engine(inputs), labels)
            model_engine.backward(loss)
            model_engine.step()
            losses.append(loss.detach().float())
            if len(losses) == gas:  # a global batch: its mean loss over every rank
                mean = torch.stack(losses).mean()
                dist.all_reduce(mean)
                mean /= dist.get_world_size()
                if dist.get_rank() == 0:
                    print(f"step {step} loss {mean.item():.8f}", flush=True)
                losses, step = [], step + 1
            if step == args.steps:
                break
    if dist.get_rank() == 0:
        print("done", type(optimizer).__name__, f"samples/s {model_engine.tput_timer.avg_samples_per_sec():.1f}")


if __name__ == "__main__":
    main()
