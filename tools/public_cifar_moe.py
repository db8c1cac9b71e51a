"""Run DeepSpeedExamples' CIFAR-10 script (training/cifar/cifar10_deepspeed.py, its --moe path: DeepSpeed's
MoE layers with expert parallelism, optimizer groups from split_params_into_different_moe_groups_for_optimizer)
unchanged but for its data and its seed: torchvision's CIFAR-10 becomes seeded random images (this machine has neither
torchvision nor the download), and every loss the script computes is recorded at full precision. Under
DeepSpeed's interpreter it trains with real DeepSpeed; with ZEROTRON_AS_DEEPSPEED=1 and zerotron's, with
zerotron. Rank 0 prints its losses as JSON:

    torchrun --standalone --nproc_per_node 2 tools/public_cifar_moe.py PATH/cifar10_deepspeed.py \\
        --moe --ep-world-size 2 --num-experts 2 --top-k 1 --noisy-gate-policy RSample --moe-param-group \\
        --dtype fp32 --stage 2 -e 1

`tools/public_cifar_moe.py rename PATH/cifar10_deepspeed.py ...` runs it the first way in, without the alias: a
copy with its DeepSpeed imports renamed to zerotron's (public_script.py's `rename`).
"""

from __future__ import annotations

import importlib
import json
import os
import runpy
import sys
import types

import public_script  # (tools/ is the script's directory)
import torch
from public_script import LOSSES, recorded, renamed

os.environ.setdefault("DS_ACCELERATOR", "cpu")
TRAIN, TEST = 128, 16  # samples: 8 steps an epoch at the script's global batch of 16


class _RandomCifar(torch.utils.data.Dataset):
    """CIFAR-10's shape (3 x 32 x 32 images, 10 classes), seeded by split."""

    def __init__(self, root=None, train=True, download=False, transform=None):
        g = torch.Generator().manual_seed(0 if train else 1)
        n = TRAIN if train else TEST
        self.images = torch.randn(n, 3, 32, 32, generator=g)
        # every class in the test split: the script's per-class accuracy divides by each class's count
        self.labels = torch.randint(0, 10, (n,), generator=g) if train else torch.arange(n) % 10

    def __len__(self):
        return len(self.images)

    def __getitem__(self, i):
        return self.images[i], int(self.labels[i])


def _fake_torchvision() -> types.ModuleType:
    transforms = types.SimpleNamespace(Compose=lambda steps: None, ToTensor=lambda: None, Normalize=lambda *a: None)
    module = types.ModuleType("torchvision")
    module.datasets = types.SimpleNamespace(CIFAR10=_RandomCifar)
    module.transforms = transforms
    return module


def main():
    script, *args = sys.argv[1:]
    if script == "rename":
        script, *args = args
        script = renamed(script, "")
    sys.argv = [script, *args]
    sys.modules["torchvision"] = _fake_torchvision()
    sys.modules["torchvision.transforms"] = sys.modules["torchvision"].transforms
    torch.nn.functional.cross_entropy = recorded(torch.nn.functional.cross_entropy)
    torch.manual_seed(0)  # the script leaves its weights and RSample noise to torch's per-process random seed
    deepspeed = importlib.import_module(public_script.ENGINE)
    runpy.run_path(script, run_name="__main__")
    if torch.distributed.get_rank() == 0:
        system = "zerotron" if hasattr(deepspeed, "Config") else f"deepspeed {deepspeed.__version__}"
        print("LOSSES " + json.dumps({"system": system, "losses": LOSSES}))


if __name__ == "__main__":
    main()
