"""`deepspeed.runtime.dataloader`: RepeatingLoader and DeepSpeedDataLoader.

zerotron's engine builds its own loader for `training_data` (a torch DataLoader over
zerotron.data.ResumableDistributedSampler); DeepSpeedDataLoader is for scripts that build one
themselves the DeepSpeed way.
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, RandomSampler
from torch.utils.data.distributed import DistributedSampler


class RepeatingLoader:
    """Iterate `loader` forever: when it is exhausted, start it again (a DataLoader's sampler
    then reshuffles as it would for a new epoch)."""

    def __init__(self, loader):
        self.loader = loader
        self.data_iter = iter(loader)

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self.data_iter)
        except StopIteration:
            self.data_iter = iter(self.loader)
            return next(self.data_iter)


class DeepSpeedDataLoader:
    """DeepSpeed's constructor arguments over a torch DataLoader: each data-parallel rank reads
    its share through a DistributedSampler (the sizes default to the current engine's
    data-parallel group), or all of the data through a RandomSampler when local_rank < 0."""

    def __init__(
        self,
        dataset,
        batch_size,
        pin_memory,
        local_rank,
        tput_timer,
        collate_fn=None,
        num_local_io_workers=None,
        data_sampler=None,
        data_parallel_world_size=None,
        data_parallel_rank=None,
        dataloader_drop_last=False,
        deepspeed_dataloader_config=None,
    ):
        if (deepspeed_dataloader_config or {}).get("curriculum_learning"):
            raise ValueError("curriculum learning (DeepSpeed's data efficiency library) is not supported by zerotron")
        from ..utils import groups

        if data_sampler is None:
            if local_rank >= 0:
                data_sampler = DistributedSampler(
                    dataset,
                    num_replicas=groups._get_data_parallel_world_size()
                    if data_parallel_world_size is None
                    else data_parallel_world_size,
                    rank=groups._get_data_parallel_rank() if data_parallel_rank is None else data_parallel_rank,
                )
            else:
                data_sampler = RandomSampler(dataset)
        self.dataset, self.batch_size, self.tput_timer = dataset, batch_size, tput_timer
        self.data_sampler = data_sampler
        self.pin_memory = pin_memory and torch.cuda.is_available()
        self.collate_fn, self.num_local_io_workers = collate_fn, num_local_io_workers or 0
        self.dataloader_drop_last = dataloader_drop_last
        self.dataloader = DataLoader(
            dataset,
            batch_size=batch_size,
            sampler=data_sampler,
            collate_fn=collate_fn,
            pin_memory=self.pin_memory,
            num_workers=self.num_local_io_workers,
            drop_last=dataloader_drop_last,
        )
        self.len = len(self.dataloader)
        self.data = None

    def __iter__(self):
        self.data = iter(self.dataloader)
        return self

    def __len__(self):
        return self.len

    def __next__(self):
        if self.tput_timer is not None and hasattr(self.tput_timer, "start"):
            self.tput_timer.start()
        if self.data is None:
            self.data = iter(self.dataloader)
        return next(self.data)
