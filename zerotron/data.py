"""Embedded training corpus and a resumable distributed sampler.

The corpus is the running interpreter's own standard library source, read as
bytes (vocab 256): every machine that can run zerotron already has it, so
training and tests never download anything.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import sysconfig

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

VOCAB_SIZE = 256

# Directory names skipped anywhere in the tree: third-party packages are not
# the stdlib, and the test suites / IDLE are large, repetitive and would
# dominate the corpus.
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib"})

# One file in _VAL_EVERY goes to validation (about 5%).
_VAL_EVERY = 20

# When max_bytes caps train, val keeps the natural 5:95 ratio but never drops
# below this, so a few windows of any sensible seq_len still fit.
_MIN_VAL_BYTES = 32 * 1024


def _corpus_files(root: str) -> list[str]:
    """Relative POSIX paths of the corpus files under root, sorted.

    Sorted relative paths (not os.walk order, which is filesystem-dependent)
    make the byte stream identical on every machine with the same stdlib.
    """
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Pruning dirnames in place stops os.walk descending into them.
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS]
        rel_dir = os.path.relpath(dirpath, root)
        for name in filenames:
            if name.endswith(".py"):
                rel = os.path.normpath(os.path.join(rel_dir, name))
                found.append(rel.replace(os.sep, "/"))
    return sorted(found)


def _is_val(relpath: str) -> bool:
    # hashlib, not hash(): hash() of str is salted per process
    # (PYTHONHASHSEED), so the split would change from run to run.
    digest = hashlib.sha256(relpath.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % _VAL_EVERY == 0


def _split_files(root: str) -> tuple[list[str], list[str]]:
    """(train, val) relative paths, each in sorted order."""
    files = _corpus_files(root)
    return [f for f in files if not _is_val(f)], [f for f in files if _is_val(f)]


def _read_capped(root: str, relpaths: list[str], cap: int | None) -> bytearray:
    buf = bytearray()
    for rel in relpaths:
        if cap is not None and len(buf) >= cap:
            break  # stop reading early: small capped loads stay fast
        with open(os.path.join(root, rel), "rb") as f:
            buf += f.read()
    if cap is not None:
        del buf[cap:]
    return buf


@functools.lru_cache(maxsize=None)
def _load_corpus_cached(root: str, max_bytes: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    train_files, val_files = _split_files(root)
    if not train_files or not val_files:
        raise RuntimeError(
            f"no usable corpus under the stdlib path {root!r}: found "
            f"{len(train_files)} train and {len(val_files)} validation *.py files "
            f"(excluding {sorted(_EXCLUDED_DIRS)}); the interpreter's stdlib source is required"
        )
    # val : train is 1 : (_VAL_EVERY - 1) by file count, so keep that ratio.
    val_cap = None if max_bytes is None else max(max_bytes // (_VAL_EVERY - 1), _MIN_VAL_BYTES)
    train = _read_capped(root, train_files, max_bytes)
    val = _read_capped(root, val_files, val_cap)
    # frombuffer shares memory with the bytearray (no copy) and keeps it alive.
    return torch.frombuffer(train, dtype=torch.uint8), torch.frombuffer(val, dtype=torch.uint8)


def load_corpus(max_bytes: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (train, val) uint8 tensors of the stdlib source corpus.

    Files are concatenated in sorted relative-path order; a stable hash of the
    path sends about 5% of files to val. max_bytes caps train (val is capped
    to the same 5:95 proportion, at least 32 KiB) so small runs load fast.

    The result is cached per process and shared between callers: treat the
    tensors as read-only.
    """
    if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1):
        raise ValueError(f"max_bytes must be a positive int or None, got {max_bytes!r}")
    # Normalise through one call site so load_corpus() and load_corpus(None)
    # hit the same cache entry.
    return _load_corpus_cached(sysconfig.get_paths()["stdlib"], max_bytes)


class TokenWindows(Dataset):
    """Non-overlapping next-byte-prediction windows over a 1-D uint8 tensor.

    Item i is (x, y), int64, length seq_len, read from the seq_len+1 bytes
    starting at i*seq_len; y is x shifted left by one. Consecutive windows
    share one byte (the last target of i is the first input of i+1), so every
    byte but the first is a target exactly once.
    """

    def __init__(self, data: torch.Tensor, seq_len: int):
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        if data.dim() != 1 or data.dtype != torch.uint8:
            raise ValueError(f"data must be a 1-D uint8 tensor, got {data.dtype} with shape {tuple(data.shape)}")
        if len(data) < seq_len + 1:
            raise ValueError(
                f"data has {len(data)} bytes, fewer than one window of seq_len+1 = {seq_len + 1}; "
                f"use a shorter seq_len or more data (larger max_bytes)"
            )
        self.data, self.seq_len = data, seq_len

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.seq_len

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < len(self):
            # IndexError (not a silent short slice) so plain iteration stops.
            raise IndexError(f"window {i} out of range for {len(self)} windows")
        chunk = self.data[i * self.seq_len : (i + 1) * self.seq_len + 1].long()
        return chunk[:-1], chunk[1:]


class ResumableDistributedSampler(Sampler[int]):
    """DistributedSampler that can stop anywhere and resume exactly there, under any number of
    replicas.

    Epoch e's global order is a permutation from a torch.Generator seeded with
    seed + e (identity if not shuffle); rank r takes positions r, r+R, r+2R, ...
    and the epoch ends where fewer than R positions remain (drop_last), or is
    wrap-padded to a multiple of R. From the epoch's start that is torch's
    DistributedSampler split, so the ranks' union is the global order.

    infinite=True (default): one iterator runs forever, moving to the next
    epoch itself. infinite=False: each iter() yields the rest of the current
    epoch, like torch's sampler with set_epoch.

    Position: (epoch, position), where position counts the samples of the
    global order that all ranks together have been handed in that epoch. It
    is the same on every rank, so state_dict() holds no rank and one rank's
    state restores all, and it does not depend on R: a sampler with another
    number of replicas (another data-parallel size) resumes from it by
    splitting the rest of the epoch, position onwards, over its own ranks.
    No sample of the epoch is then seen twice or skipped (drop_last drops
    fewer than R at the end of the epoch, as always). A finished epoch is
    recorded as (epoch + 1, 0).

    Caution: a DataLoader pulls indices ahead of the batches the training
    loop has consumed (prefetching with num_workers > 0), so state_dict()
    may be ahead of training. The engine should count consumed samples per
    rank itself and restore with set_position(*divmod(consumed, len(sampler)))
    (for a run that began at epoch 0, offset 0). Only one live iterator at a
    time: iterators share the sampler's position.
    """

    def __init__(
        self,
        dataset_len,
        num_replicas: int,
        rank: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
        infinite: bool = True,
    ):
        n = dataset_len if isinstance(dataset_len, int) else len(dataset_len)
        if n < 1:
            raise ValueError(f"dataset is empty (length {n})")
        if num_replicas < 1:
            raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank must be in [0, {num_replicas - 1}] for num_replicas={num_replicas}, got {rank}")
        self.dataset_len, self.num_replicas, self.rank = n, num_replicas, rank
        self.shuffle, self.seed, self.drop_last, self.infinite = shuffle, seed, drop_last, infinite
        self.num_samples = self._per_rank(0)
        if self.num_samples == 0:
            # Would make the infinite iterator spin forever yielding nothing.
            raise ValueError(
                f"dataset of length {n} gives no samples per rank for num_replicas={num_replicas} "
                f"with drop_last=True; use more data or drop_last=False"
            )
        # The current segment of the epoch starts at global position `start` (0, or where a run
        # with another number of replicas stopped); `offset` counts this rank's indices since then.
        self.epoch, self.start, self.offset = 0, 0, 0
        self._cache: tuple[tuple[int, int], list[int]] | None = None  # ((epoch, start), this rank's indices)

    def __len__(self) -> int:
        """Samples per rank per epoch (also in infinite mode, where it is the epoch length)."""
        return self.num_samples

    def _per_rank(self, start: int) -> int:
        """This rank's share of the epoch from global position `start` on: the rest split evenly,
        rounded down (drop_last) or up (the remainder wrap-padded)."""
        rest = self.dataset_len - start
        return rest // self.num_replicas if self.drop_last else -(-rest // self.num_replicas)

    def _indices(self, epoch: int, start: int) -> list[int]:
        if self._cache is not None and self._cache[0] == (epoch, start):
            return self._cache[1]
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + epoch)
            order = torch.randperm(self.dataset_len, generator=g).tolist()
        else:
            order = list(range(self.dataset_len))
        end = start + self._per_rank(start) * self.num_replicas
        if end > len(order):  # wrap around (repeating the whole order if the pad is larger)
            order = order * math.ceil(end / len(order))
        mine = order[start + self.rank : end : self.num_replicas]
        self._cache = ((epoch, start), mine)
        return mine

    def epoch_indices(self, epoch: int) -> list[int]:
        """This rank's indices for the given epoch from its start, in order."""
        return self._indices(epoch, 0)

    def __iter__(self):
        start_epoch = self.epoch
        # Read the position from self on every step, so set_position/
        # load_state_dict take effect and the position is always current.
        while self.infinite or self.epoch == start_epoch:
            mine = self._indices(self.epoch, self.start)
            if self.offset >= len(mine):  # a resumed epoch with nothing left for R replicas
                self._next_epoch()
                continue
            index = mine[self.offset]
            # Advance before yielding: once the caller has the index it counts
            # as yielded, even if the caller never asks for the next one.
            self.offset += 1
            if self.offset == len(mine):
                self._next_epoch()
            yield index

    def _next_epoch(self) -> None:
        self.epoch, self.start, self.offset = self.epoch + 1, 0, 0

    @property
    def position(self) -> int:
        """Samples of the current epoch's global order handed out over all ranks."""
        return self.start + self.offset * self.num_replicas

    def set_epoch(self, epoch: int) -> None:
        """Start `epoch` from its beginning, unless it is already the current
        epoch: then keep the offset, so a resumed run's usual
        `for e in range(start, n): sampler.set_epoch(e)` does not rewind."""
        if epoch != self.epoch:
            self.set_position(epoch, 0)

    def set_position(self, epoch: int, offset: int) -> None:
        """Resume so the next index yielded is number `offset` of `epoch` (counted per rank)."""
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        if not 0 <= offset <= self.num_samples:
            raise ValueError(f"offset must be in [0, {self.num_samples}] (samples per rank per epoch), got {offset}")
        if offset == self.num_samples:
            epoch, offset = epoch + 1, 0  # a finished epoch, recorded as usual
        self.epoch, self.start, self.offset = int(epoch), 0, int(offset)

    def state_dict(self) -> dict:
        """JSON-serialisable position plus the settings that fix the order."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "dataset_len": self.dataset_len,
            "num_replicas": self.num_replicas,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
        }

    def load_state_dict(self, sd: dict) -> None:
        """Resume where `sd` was taken, with this sampler's number of replicas (which may differ)."""
        # A different length/shuffle/drop_last would give a different order, so "resume" would
        # silently replay or skip data.
        for key in ("dataset_len", "shuffle", "drop_last"):
            if key in sd and sd[key] != getattr(self, key):
                raise ValueError(
                    f"sampler state has {key}={sd[key]!r} but this sampler has {getattr(self, key)!r}; "
                    f"resume with the same data and settings"
                )
        self.seed = int(sd["seed"])
        self._cache = None  # the seed may have changed
        # Older states counted per rank (offset) over num_replicas ranks.
        position = sd["position"] if "position" in sd else int(sd["offset"]) * int(sd.get("num_replicas", 1))
        if not 0 <= int(position) < self.dataset_len:
            raise ValueError(f"sampler state has position {position}, outside an epoch of {self.dataset_len} samples")
        # The rest of the epoch from `position` on, split over this sampler's replicas (empty when
        # fewer than num_replicas samples are left and drop_last drops them).
        self.epoch, self.start, self.offset = int(sd["epoch"]), int(position), 0


def corpus_loaders(
    seq_len: int,
    micro_batch: int,
    num_replicas: int,
    rank: int,
    seed: int = 0,
    max_bytes: int | None = None,
    global_batch: int | None = None,
) -> tuple[DataLoader, TokenWindows]:
    """(train_loader, val_dataset) over the stdlib corpus for this rank.

    The train loader never ends (infinite sampler) and yields (x, y) int64
    batches of shape (micro_batch, seq_len); its sampler is
    `train_loader.sampler`, for state_dict/set_position. num_workers=0, so
    the sampler's position equals the samples this rank has drawn.
    """
    if micro_batch < 1:
        raise ValueError(f"micro_batch must be >= 1, got {micro_batch}")
    train, val = load_corpus(max_bytes)
    train_ds = TokenWindows(train, seq_len)
    need = global_batch or micro_batch * num_replicas
    if len(train_ds) < need:
        raise ValueError(
            f"the training data holds {len(train_ds)} sequences of {seq_len} tokens, fewer than one global "
            f"batch ({need}): use more data (--corpus-bytes), a shorter --seq-len or a smaller batch"
        )
    sampler = ResumableDistributedSampler(len(train_ds), num_replicas, rank, shuffle=True, seed=seed)
    loader = DataLoader(train_ds, batch_size=micro_batch, sampler=sampler, num_workers=0)
    return loader, TokenWindows(val, seq_len)
