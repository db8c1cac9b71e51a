"""A small AlexNet-style network as a two-stage pipeline built from its layer list, trained with
`engine.train_batch()` from a RepeatingLoader, in the style of DeepSpeed's pipeline-parallel
example (random images; nothing is downloaded). Written for DeepSpeed; runs on zerotron unchanged:

    zerotron run --as-deepspeed -n 2 examples/deepspeed/pipeline_layers.py \
        --deepspeed_config examples/deepspeed/pipeline_layers.json --pipeline-parallel-size 2
"""

import argparse

import deepspeed
import torch
import torch.nn as nn
from deepspeed.pipe import PipelineModule
from deepspeed.utils import RepeatingLoader


class AlexNetStyle(nn.Module):
    def __init__(self, num_classes=10):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
        )
        self.avgpool = nn.AdaptiveAvgPool2d((2, 2))
        self.classifier = nn.Sequential(nn.Linear(32 * 2 * 2, 64), nn.ReLU(inplace=True), nn.Linear(64, num_classes))


def join_layers(vision_model):
    return [*vision_model.features, vision_model.avgpool, lambda x: torch.flatten(x, 1), *vision_model.classifier]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--pipeline-parallel-size", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1138)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(args.seed)
    generator = torch.Generator().manual_seed(7)
    trainset = torch.utils.data.TensorDataset(
        torch.randn(128, 3, 16, 16, generator=generator), torch.randint(0, 10, (128,), generator=generator)
    )
    net = PipelineModule(
        layers=join_layers(AlexNetStyle()),
        loss_fn=nn.CrossEntropyLoss(),
        num_stages=args.pipeline_parallel_size,
        partition_method="parameters",
        activation_checkpoint_interval=0,
    )
    engine, _, loader, _ = deepspeed.initialize(
        args=args, model=net, model_parameters=[p for p in net.parameters() if p.requires_grad], training_data=trainset
    )
    data_iter = iter(RepeatingLoader(loader))
    for step in range(args.steps):
        loss = engine.train_batch(data_iter=data_iter)
        if engine.global_rank == 0:
            print(f"step {step} loss {loss.item():.8f}", flush=True)


if __name__ == "__main__":
    main()
