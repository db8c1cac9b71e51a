"""Training metrics to TensorBoard and/or CSV files, as DeepSpeed's `tensorboard` / `csv_monitor`."""

from __future__ import annotations

import csv
import os

from .config import Config, MonitorConfig


class CSVWriter:
    """One CSV file per metric (DeepSpeed's layout): <output_path>/<job_name>/<metric>.csv."""

    def __init__(self, cfg: MonitorConfig):
        self.dir = os.path.join(cfg.output_path or "csv_monitor", cfg.job_name)
        os.makedirs(self.dir, exist_ok=True)

    def write(self, events):
        for name, value, step in events:
            path = os.path.join(self.dir, name.replace("/", "_") + ".csv")
            new = not os.path.exists(path)
            with open(path, "a", newline="") as f:
                w = csv.writer(f)
                if new:
                    w.writerow(["step", name])
                w.writerow([step, value])

    def close(self):
        pass


class TensorBoardWriter:
    def __init__(self, cfg: MonitorConfig):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise ImportError("the 'tensorboard' monitor needs the tensorboard package: pip install tensorboard") from e
        self.writer = SummaryWriter(log_dir=os.path.join(cfg.output_path or "runs", cfg.job_name))

    def write(self, events):
        for name, value, step in events:
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def close(self):
        self.writer.close()


class Monitor:
    """Fans events out to the enabled writers; only rank 0 writes."""

    def __init__(self, config: Config, rank: int):
        self.writers = []
        if rank == 0:
            if config.tensorboard.enabled:
                self.writers.append(TensorBoardWriter(config.tensorboard))
            if config.csv_monitor.enabled:
                self.writers.append(CSVWriter(config.csv_monitor))

    @property
    def enabled(self) -> bool:
        return bool(self.writers)

    def write(self, events: list[tuple[str, float, int]]):
        for w in self.writers:
            w.write(events)

    def close(self):
        for w in self.writers:
            w.close()
