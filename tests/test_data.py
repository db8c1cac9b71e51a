import itertools
import json
import os
import sysconfig

import pytest
import torch

from zerotron import data as zdata
from zerotron.data import ResumableDistributedSampler, TokenWindows, corpus_loaders, load_corpus

CAP = 200_000
STDLIB = sysconfig.get_paths()["stdlib"]


def take(it, n):
    return list(itertools.islice(it, n))


# ---------------------------------------------------------------- corpus


def test_corpus_capped_shapes_and_dtype():
    train, val = load_corpus(CAP)
    assert train.dtype == torch.uint8 and val.dtype == torch.uint8
    assert train.dim() == 1 and val.dim() == 1
    assert len(train) == CAP  # the stdlib is far larger than the cap
    assert 0 < len(val) < len(train)


def test_corpus_deterministic_and_cached():
    a = load_corpus(CAP)
    assert load_corpus(CAP) is a  # cached in-process
    zdata._load_corpus_cached.cache_clear()
    b = load_corpus(CAP)
    assert b is not a  # really reloaded ...
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])  # ... identically


def test_corpus_is_the_sorted_stdlib_files():
    train_files, val_files = zdata._split_files(STDLIB)
    train, val = load_corpus(CAP)
    for files, tensor in ((train_files, train), (val_files, val)):
        with open(os.path.join(STDLIB, files[0]), "rb") as f:
            first = f.read()
        n = min(len(first), len(tensor))
        assert bytes(tensor[:n].tolist()) == first[:n]
        assert files == sorted(files)


def test_split_disjoint_and_about_five_percent():
    train_files, val_files = zdata._split_files(STDLIB)
    assert train_files and val_files
    assert not set(train_files) & set(val_files)
    assert sorted(train_files + val_files) == zdata._corpus_files(STDLIB)
    assert 0.02 < len(val_files) / (len(train_files) + len(val_files)) < 0.10
    # The split depends only on the path, not on process hash salting.
    assert [zdata._is_val(f) for f in val_files] == [True] * len(val_files)


def test_corpus_excludes_tests_site_packages_idlelib():
    for rel in zdata._corpus_files(STDLIB):
        parts = rel.split("/")
        assert rel.endswith(".py")
        assert not set(parts[:-1]) & {"site-packages", "dist-packages", "test", "tests", "idlelib"}, rel


def test_corpus_files_walk_fake_tree(tmp_path):
    for rel in [
        "a.py",
        "pkg/b.py",
        "pkg/notes.txt",
        "test/t.py",
        "pkg/tests/t.py",
        "site-packages/x.py",
        "dist-packages/y.py",
        "idlelib/z.py",
        "testing/k.py",
    ]:
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("pass\n")
    assert zdata._corpus_files(str(tmp_path)) == ["a.py", "pkg/b.py", "testing/k.py"]


def test_corpus_missing_stdlib_raises(tmp_path, monkeypatch):
    monkeypatch.setattr(zdata.sysconfig, "get_paths", lambda: {"stdlib": str(tmp_path)})
    with pytest.raises(RuntimeError, match=str(tmp_path)):
        load_corpus(CAP)


@pytest.mark.parametrize("bad", [0, -5, 1.5, True])
def test_corpus_bad_cap(bad):
    with pytest.raises(ValueError, match="max_bytes"):
        load_corpus(bad)


# ---------------------------------------------------------------- windows


def test_token_windows_shapes_and_shift():
    data = torch.arange(23, dtype=torch.uint8)
    ds = TokenWindows(data, seq_len=5)
    assert len(ds) == (23 - 1) // 5 == 4
    for i in range(len(ds)):
        x, y = ds[i]
        assert x.dtype == y.dtype == torch.int64
        assert x.shape == y.shape == (5,)
        assert x.tolist() == list(range(5 * i, 5 * i + 5))
        assert y.tolist() == list(range(5 * i + 1, 5 * i + 6))
    with pytest.raises(IndexError):
        ds[4]
    assert len(list(ds)) == 4  # plain iteration stops at IndexError


def test_token_windows_exact_fit_and_errors():
    assert len(TokenWindows(torch.zeros(6, dtype=torch.uint8), 5)) == 1
    with pytest.raises(ValueError, match="one window"):
        TokenWindows(torch.zeros(5, dtype=torch.uint8), 5)
    with pytest.raises(ValueError, match="uint8"):
        TokenWindows(torch.zeros(50, dtype=torch.int64), 5)
    with pytest.raises(ValueError, match="seq_len"):
        TokenWindows(torch.zeros(50, dtype=torch.uint8), 0)


def test_token_windows_on_corpus():
    train, _ = load_corpus(CAP)
    ds = TokenWindows(train, 128)
    x, y = ds[len(ds) - 1]
    assert torch.equal(x[1:], y[:-1])
    assert int(x.max()) < 256


# ---------------------------------------------------------------- sampler


def epoch_union(n, world, epoch=0, **kw):
    """Interleave the ranks' epoch back into the global order."""
    per_rank = []
    for r in range(world):
        s = ResumableDistributedSampler(n, world, r, infinite=False, **kw)
        s.set_epoch(epoch)
        per_rank.append(list(s))
    assert len({len(p) for p in per_rank}) == 1
    return [per_rank[r][i] for i in range(len(per_rank[0])) for r in range(world)]


def global_perm(n, seed, epoch):
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    return torch.randperm(n, generator=g).tolist()


def test_union_drop_last_is_truncated_permutation():
    n, world = 103, 4
    order = epoch_union(n, world, seed=7)
    assert order == global_perm(n, 7, 0)[:100]
    assert len(set(order)) == len(order) == 100  # each index at most once


def test_union_padded_covers_every_index():
    n, world = 103, 4
    order = epoch_union(n, world, seed=7, drop_last=False)
    perm = global_perm(n, 7, 0)
    assert order == perm + perm[:1]  # 104 = 103 + one wrapped-around index
    assert sorted(set(order)) == list(range(n))


def test_union_no_remainder_is_exact_permutation():
    order = epoch_union(96, 8, seed=3, drop_last=False)
    assert sorted(order) == list(range(96))
    assert epoch_union(96, 8, seed=3) == order


def test_padding_larger_than_dataset():
    order = epoch_union(3, 8, shuffle=False, drop_last=False)
    assert order == [0, 1, 2, 0, 1, 2, 0, 1]


def test_no_shuffle_is_identity_and_matches_torch_split():
    s = ResumableDistributedSampler(10, 3, 1, shuffle=False, infinite=False)
    assert list(s) == [1, 4, 7]
    t = torch.utils.data.DistributedSampler(range(10), 3, 1, shuffle=False, drop_last=True)
    assert list(s.epoch_indices(0)) == list(t)


def test_matches_torch_distributed_sampler_shuffled():
    for drop_last in (True, False):
        for r in range(4):
            ours = ResumableDistributedSampler(50, 4, r, seed=5, drop_last=drop_last, infinite=False)
            theirs = torch.utils.data.DistributedSampler(range(50), 4, r, seed=5, drop_last=drop_last)
            ours.set_epoch(2)
            theirs.set_epoch(2)
            assert list(ours) == list(theirs)


def test_epochs_differ_seeds_reproduce():
    assert epoch_union(64, 2, epoch=0) != epoch_union(64, 2, epoch=1)
    assert epoch_union(64, 2, seed=1) == epoch_union(64, 2, seed=1)
    assert epoch_union(64, 2, seed=1) != epoch_union(64, 2, seed=2)


def test_infinite_crosses_epochs():
    s = ResumableDistributedSampler(20, 2, 0, seed=4)
    seq = take(iter(s), 25)
    assert seq[:10] == s.epoch_indices(0)
    assert seq[10:20] == s.epoch_indices(1)
    assert seq[20:] == s.epoch_indices(2)[:5]
    assert s.state_dict()["epoch"] == 2 and s.state_dict()["position"] == 10  # 5 per rank, over 2 ranks


def test_finite_one_epoch_per_iter():
    s = ResumableDistributedSampler(20, 2, 1, seed=4, infinite=False)
    assert len(s) == 10
    first = list(s)
    assert first == s.epoch_indices(0) and len(first) == 10
    assert (s.epoch, s.offset) == (1, 0)  # finished epoch recorded as the next one
    s.set_epoch(1)  # the usual loop call does not rewind
    second = list(s)
    assert second == s.epoch_indices(1) and second != first


@pytest.mark.parametrize("stop", [0, 3, 9, 10, 17, 33])
@pytest.mark.parametrize("drop_last", [True, False])
def test_resume_infinite_identical_continuation(stop, drop_last):
    # n=21, world=2: 10 per rank (drop_last) or 11 (padded); stops include
    # mid-epoch, exactly at an epoch boundary, and several epochs in.
    kw = dict(num_replicas=2, rank=1, seed=11, drop_last=drop_last)
    ref = take(iter(ResumableDistributedSampler(21, **kw)), stop + 40)

    a = ResumableDistributedSampler(21, **kw)
    it = iter(a)
    assert take(it, stop) == ref[:stop]
    sd = json.loads(json.dumps(a.state_dict()))  # must survive JSON

    b = ResumableDistributedSampler(21, num_replicas=2, rank=1, seed=0, drop_last=drop_last)
    b.load_state_dict(sd)  # also restores the seed
    assert take(iter(b), 40) == ref[stop:]
    assert take(it, 40) == ref[stop:]  # the original continues the same way


def test_resume_finite_mid_epoch_and_boundary():
    kw = dict(num_replicas=3, rank=2, seed=9, infinite=False)
    ref = ResumableDistributedSampler(40, **kw)
    ref_epochs = [list(ref) for _ in range(3)]

    a = ResumableDistributedSampler(40, **kw)
    assert take(iter(a), 5) == ref_epochs[0][:5]
    b = ResumableDistributedSampler(40, **kw)
    b.load_state_dict(a.state_dict())
    assert list(b) == ref_epochs[0][5:]  # rest of the epoch only
    assert list(b) == ref_epochs[1]  # next iter is the next epoch

    c = ResumableDistributedSampler(40, **kw)
    c.load_state_dict(b.state_dict())  # saved exactly at an epoch boundary
    assert list(c) == ref_epochs[2]


def test_set_position_matches_consumed_count():
    s = ResumableDistributedSampler(30, 3, 0, seed=2)
    ref = take(iter(ResumableDistributedSampler(30, 3, 0, seed=2)), 50)
    consumed = 23  # e.g. what the engine counted
    s.set_position(*divmod(consumed, len(s)))
    assert take(iter(s), 27) == ref[23:]
    s.set_position(0, len(s))  # an exhausted epoch means the next one
    assert (s.epoch, s.offset) == (1, 0)


def test_state_dict_is_rank_independent():
    a = ResumableDistributedSampler(30, 3, 0, seed=2)
    b = ResumableDistributedSampler(30, 3, 2, seed=2)
    take(iter(a), 7)
    b.load_state_dict(a.state_dict())
    ref = ResumableDistributedSampler(30, 3, 2, seed=2)
    it = iter(ref)
    take(it, 7)
    assert take(iter(b), 12) == take(it, 12)


def test_sampler_argument_errors():
    with pytest.raises(ValueError, match="num_replicas"):
        ResumableDistributedSampler(10, 0, 0)
    with pytest.raises(ValueError, match="rank"):
        ResumableDistributedSampler(10, 2, 2)
    with pytest.raises(ValueError, match="rank"):
        ResumableDistributedSampler(10, 2, -1)
    with pytest.raises(ValueError, match="empty"):
        ResumableDistributedSampler(0, 1, 0)
    with pytest.raises(ValueError, match="no samples per rank"):
        ResumableDistributedSampler(3, 4, 0)
    s = ResumableDistributedSampler(10, 2, 0)
    with pytest.raises(ValueError, match="offset"):
        s.set_position(0, 6)
    with pytest.raises(ValueError, match="epoch"):
        s.set_position(-1, 0)
    with pytest.raises(ValueError, match="dataset_len"):
        s.load_state_dict(ResumableDistributedSampler(12, 2, 0).state_dict())


def _epoch_from(state, n, world, **kw):
    """The rest of the epoch after `state`, resumed on `world` replicas, interleaved back into one order."""
    per_rank = []
    for r in range(world):
        s = ResumableDistributedSampler(n, world, r, infinite=False, **kw)
        s.load_state_dict(state)
        per_rank.append(list(s))
    assert len({len(p) for p in per_rank}) == 1, "the ranks must draw equally"
    return [per_rank[r][i] for i in range(len(per_rank[0])) for r in range(world)]


@pytest.mark.parametrize("before,after", [(2, 1), (1, 2), (2, 4), (4, 2), (3, 2), (2, 3), (4, 3)])
@pytest.mark.parametrize("drop_last", [True, False])
def test_resume_on_another_number_of_replicas_continues_the_epoch(before, after, drop_last):
    """A state saved on `before` replicas, resumed on `after`: the rest of the epoch is the global order
    from the saved position on, nothing seen twice, nothing skipped but the end that drop_last drops
    (fewer than `after`); the next epoch is the new world's usual split."""
    n = 103
    perm = global_perm(n, 7, 0)
    for consumed_per_rank in (0, 1, 5, n // before - 1):
        ranks = [ResumableDistributedSampler(n, before, r, seed=7, drop_last=drop_last) for r in range(before)]
        its = [iter(s) for s in ranks]
        seen = [i for _ in range(consumed_per_rank) for it in its for i in [next(it)]]
        state = json.loads(json.dumps(ranks[0].state_dict()))
        assert state == ranks[-1].state_dict() and state["position"] == len(seen)
        rest = _epoch_from(state, n, after, seed=7, drop_last=drop_last)
        whole = seen + rest
        if drop_last:
            assert whole == perm[: len(whole)] and n - after < len(whole) <= n
        else:
            assert whole[:n] == perm and len(whole) - n < after  # the pad wraps around
        follower = ResumableDistributedSampler(n, after, 0, seed=7, drop_last=drop_last, infinite=False)
        follower.load_state_dict(state)
        list(follower)  # the rest of this epoch
        assert list(follower) == follower.epoch_indices(1)


def test_an_old_state_counted_per_rank_still_loads():
    s = ResumableDistributedSampler(40, 4, 1, seed=3)
    s.load_state_dict(
        {"epoch": 1, "offset": 3, "seed": 3, "dataset_len": 40, "num_replicas": 2, "shuffle": True, "drop_last": True}
    )
    assert s.state_dict()["position"] == 6 and next(iter(s)) == global_perm(40, 3, 1)[7]


def test_sampler_accepts_dataset():
    ds = TokenWindows(torch.zeros(101, dtype=torch.uint8), 10)
    assert len(ResumableDistributedSampler(ds, 2, 0)) == 5


# ---------------------------------------------------------------- loaders


def test_corpus_loaders_batches_and_resume():
    loader, val = corpus_loaders(seq_len=64, micro_batch=4, num_replicas=2, rank=1, seed=3, max_bytes=CAP)
    assert isinstance(val, TokenWindows) and len(val) > 4
    it = iter(loader)
    x, y = next(it)
    assert x.shape == y.shape == (4, 64) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    # Loop past one epoch: the loader never ends.
    n_batches = len(loader.sampler) // 4 + 2
    for _ in range(n_batches):
        next(it)
    sd = loader.sampler.state_dict()
    assert sd["epoch"] == 1
    expect = next(it)

    loader2, _ = corpus_loaders(seq_len=64, micro_batch=4, num_replicas=2, rank=1, seed=3, max_bytes=CAP)
    loader2.sampler.load_state_dict(sd)
    got = next(iter(loader2))
    assert torch.equal(got[0], expect[0]) and torch.equal(got[1], expect[1])


def test_set_epoch_same_epoch_keeps_resumed_offset():
    s = ResumableDistributedSampler(40, 2, 0, seed=1, infinite=False)
    s.set_position(2, 7)
    s.set_epoch(2)  # a resumed loop re-announcing the current epoch
    assert list(s) == s.epoch_indices(2)[7:]
    s.set_epoch(0)  # a different epoch starts from its beginning
    assert list(s) == s.epoch_indices(0)
