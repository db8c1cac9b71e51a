"""tools/public_script.py's `imagenet` stand-in, for DeepSpeedExamples' training/imagenet/main.py (torchvision has no
CPU build on this machine's index, and ImageNet is not here): `torchvision.models` lists `resnet18`, torchvision's
ResNet-18 architecture written out, and `torchvision.datasets.FakeData` (the script's `--dummy` data) gives
seeded random 3 x 32 x 32 images, at most 64 of them, so an epoch is a few steps.

    cd PATH/training/imagenet
    torchrun --standalone --nproc_per_node 2 TOOLS/public_script.py imagenet,cpu main.py ARGS   # real DeepSpeed
    zerotron run -n 2 --as-deepspeed TOOLS/public_script.py imagenet,cpu main.py ARGS           # zerotron

ARGS (run_ds.sh's, cut to size): -a resnet18 --deepspeed --deepspeed_config CONFIG --multiprocessing_distributed
--dummy --epochs 1 -b 8 -j 0 -p 1 --seed 0, CONFIG being config/ds_config.json with train_batch_size 16. The
script also imports openpyxl (it writes its losses to a spreadsheet): the package must be importable.
"""

from __future__ import annotations

import torch
from torch import nn


class _BasicBlock(nn.Module):
    """Two 3 x 3 convolutions with batch norm, added to the input (through a 1 x 1 convolution where the shape
    changes), then ReLU."""

    def __init__(self, inplanes: int, planes: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = None
        if stride != 1 or inplanes != planes:
            self.downsample = nn.Sequential(nn.Conv2d(inplanes, planes, 1, stride, bias=False), nn.BatchNorm2d(planes))

    def forward(self, x):
        out = self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x)))))
        return self.relu(out + (x if self.downsample is None else self.downsample(x)))


class ResNet18(nn.Module):
    """torchvision's resnet18: a 7 x 7 stem and max pool, four stages of two basic blocks (64, 128, 256, 512
    channels), global average pool, one linear layer; convolutions initialized Kaiming-normal (fan out)."""

    def __init__(self, num_classes: int = 1000, pretrained: bool = False):
        super().__init__()
        if pretrained:
            raise ValueError("the resnet18 stand-in has no pretrained weights (nothing is downloaded here)")
        self.conv1 = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        widths, inplanes = (64, 128, 256, 512), 64
        for i, planes in enumerate(widths):
            stride = 1 if i == 0 else 2
            blocks = [_BasicBlock(inplanes, planes, stride), _BasicBlock(planes, planes)]
            setattr(self, f"layer{i + 1}", nn.Sequential(*blocks))
            inplanes = planes
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class FakeData(torch.utils.data.Dataset):
    """torchvision's FakeData signature; seeded random 3 x 32 x 32 images (at most 64) and labels."""

    def __init__(self, size=1000, image_size=(3, 224, 224), num_classes=10, transform=None, target_transform=None):
        g = torch.Generator().manual_seed(size % 1000)
        n = min(size, 64)
        self.images = torch.randn(n, 3, 32, 32, generator=g)
        self.labels = torch.randint(0, num_classes, (n,), generator=g)

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        return self.images[i], int(self.labels[i])


def install(torchvision) -> None:
    """Add the stand-ins to the `torchvision` stand-in module (public_script's `cifar10` makes it)."""
    torchvision.models.resnet18 = ResNet18
    torchvision.datasets.FakeData = FakeData
