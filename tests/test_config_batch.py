"""Config loading: the batch triple (train_batch_size, micro-batch, accumulation) against the world size,
and the tensor-parallel layout it divides.

Pure Python: no process groups. Every error case checks that the message names the key.
"""

import pytest
from config_helpers import GAS, MBS, TBS, triple

from zerotron.config import Config
from zerotron.errors import ConfigError

# (world size, given keys, expected (train_batch_size, micro, accumulation)), written out by hand.
BATCH_OK = [
    # all three, consistent
    (1, {TBS: 16, MBS: 2, GAS: 8}, (16, 2, 8)),
    (2, {TBS: 16, MBS: 2, GAS: 4}, (16, 2, 4)),
    (4, {TBS: 16, MBS: 2, GAS: 2}, (16, 2, 2)),
    # train_batch_size + micro: accumulation derived
    (1, {TBS: 16, MBS: 2}, (16, 2, 8)),
    (2, {TBS: 16, MBS: 2}, (16, 2, 4)),
    (4, {TBS: 16, MBS: 2}, (16, 2, 2)),
    (4, {TBS: 8, MBS: 2}, (8, 2, 1)),
    # train_batch_size + accumulation: micro derived
    (1, {TBS: 16, GAS: 2}, (16, 8, 2)),
    (2, {TBS: 16, GAS: 2}, (16, 4, 2)),
    (4, {TBS: 16, GAS: 2}, (16, 2, 2)),
    # micro + accumulation: train_batch_size derived
    (1, {MBS: 3, GAS: 2}, (6, 3, 2)),
    (2, {MBS: 3, GAS: 2}, (12, 3, 2)),
    (4, {MBS: 3, GAS: 2}, (24, 3, 2)),
    # only train_batch_size: accumulation 1
    (1, {TBS: 8}, (8, 8, 1)),
    (2, {TBS: 8}, (8, 4, 1)),
    (4, {TBS: 8}, (8, 2, 1)),
    # only micro: accumulation 1
    (1, {MBS: 5}, (5, 5, 1)),
    (2, {MBS: 5}, (10, 5, 1)),
    (4, {MBS: 5}, (20, 5, 1)),
    # floats that are integers are accepted for int keys
    (2, {TBS: 16.0, MBS: 2.0}, (16, 2, 4)),
]


@pytest.mark.parametrize("world_size,given,expected", BATCH_OK)
def test_batch_triple_resolves(world_size, given, expected):
    cfg = Config.load(given, world_size=world_size)
    assert triple(cfg) == expected
    assert all(type(v) is int for v in triple(cfg))
    assert cfg.dp_size == world_size
    # the invariant DeepSpeed asserts
    tbs, mbs, gas = triple(cfg)
    assert tbs == mbs * gas * world_size


# (world size, given keys, the key the error names, the value, words of the fix)
BATCH_BAD = [
    # all three, inconsistent
    (1, {TBS: 16, MBS: 2, GAS: 4}, TBS, 16, ["= 8", "leave one out"]),
    (2, {TBS: 16, MBS: 2, GAS: 8}, TBS, 16, ["= 32", "leave one out"]),
    (4, {TBS: 16, MBS: 2, GAS: 4}, TBS, 16, ["= 32", "leave one out"]),
    # train_batch_size + micro, not divisible by micro x data-parallel size
    (1, {TBS: 6, MBS: 4}, TBS, 6, ["divisible by", MBS, "(4)", "data-parallel size (1)"]),
    (2, {TBS: 6, MBS: 2}, TBS, 6, ["divisible by", MBS, "(2)", "data-parallel size (2)"]),
    (4, {TBS: 12, MBS: 2}, TBS, 12, ["divisible by", MBS, "(2)", "data-parallel size (4)"]),
    # train_batch_size + accumulation, not divisible by accumulation x data-parallel size
    (1, {TBS: 6, GAS: 4}, TBS, 6, ["divisible by", GAS, "(4)", "data-parallel size (1)"]),
    (2, {TBS: 12, GAS: 4}, TBS, 12, ["divisible by", GAS, "(4)", "data-parallel size (2)"]),
    (4, {TBS: 8, GAS: 4}, TBS, 8, ["divisible by", GAS, "(4)", "data-parallel size (4)"]),
    # only train_batch_size, not divisible by the data-parallel size
    (2, {TBS: 3}, TBS, 3, ["divisible by", "data-parallel size (2)"]),
    (4, {TBS: 6}, TBS, 6, ["divisible by", "data-parallel size (4)"]),
    # neither train_batch_size nor micro
    (1, {}, MBS, None, ["set train_micro_batch_size_per_gpu or train_batch_size"]),
    (2, {GAS: 4}, MBS, None, ["set train_micro_batch_size_per_gpu or train_batch_size"]),
    (4, {}, MBS, None, ["set train_micro_batch_size_per_gpu or train_batch_size"]),
    # zero / negative
    (1, {TBS: 0}, TBS, 0, ["positive integer"]),
    (2, {TBS: -8}, TBS, -8, ["positive integer"]),
    (1, {MBS: 0}, MBS, 0, ["positive integer"]),
    (4, {MBS: -1, GAS: 2}, MBS, -1, ["positive integer"]),
    (1, {TBS: 8, GAS: 0}, GAS, 0, ["positive integer"]),
    (2, {MBS: 2, GAS: -3}, GAS, -3, ["positive integer"]),
]


@pytest.mark.parametrize("world_size,given,key,value,fix_words", BATCH_BAD)
def test_batch_triple_errors(world_size, given, key, value, fix_words):
    with pytest.raises(ConfigError) as info:
        Config.load(given, world_size=world_size)
    err = info.value
    assert err.key == key
    assert err.value == value
    message = str(err)
    assert f"'{key}'" in message and repr(value) in message
    for words in fix_words:
        assert words in message


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_batch_error_is_raised_before_anything_else_is_touched(world_size):
    # The given dict is not modified by a failing load.
    given = {TBS: 7, MBS: 2}
    with pytest.raises(ConfigError):
        Config.load(given, world_size=world_size)
    assert given == {TBS: 7, MBS: 2}


@pytest.mark.parametrize("world_size", [0, -1])
def test_world_size_must_be_positive(world_size):
    with pytest.raises(ConfigError, match="world_size"):
        Config.load({TBS: 8}, world_size=world_size)


# ---------------------------------------------------------------- tensor parallel
def test_tensor_parallel_one_is_plain_data_parallel():
    cfg = Config.load({TBS: 16, "tensor_parallel": {"autotp_size": 1}}, world_size=4)
    assert cfg.dp_size == 4
    assert triple(cfg) == (16, 4, 1)


@pytest.mark.parametrize("world_size,tp,dp", [(2, 2, 1), (4, 2, 2), (4, 4, 1), (8, 2, 4)])
def test_tensor_parallel_divides_the_world(world_size, tp, dp):
    cfg = Config.load({TBS: 16, "tensor_parallel": {"autotp_size": tp}}, world_size=world_size)
    assert cfg.dp_size == dp and cfg.train_micro_batch_size_per_gpu == 16 // dp


@pytest.mark.parametrize("world_size,tp", [(4, 3), (2, 4), (1, 2)])
def test_tensor_parallel_that_does_not_divide_the_world(world_size, tp):
    with pytest.raises(ConfigError) as info:
        Config.load({TBS: 16, "tensor_parallel": {"autotp_size": tp}}, world_size=world_size)
    assert info.value.key == "tensor_parallel.autotp_size"
    assert "must divide the number of processes" in str(info.value)


@pytest.mark.parametrize(
    "tp,pp,key", [(1, 3, "pipeline.stages"), (3, 1, "tensor_parallel.autotp_size"), (2, 3, "pipeline.stages")]
)
def test_the_layout_error_names_the_key_the_user_set(tp, pp, key):
    with pytest.raises(ConfigError) as info:
        Config.load({TBS: 16, "pipeline": {"stages": pp}, "tensor_parallel": {"autotp_size": tp}}, world_size=2)
    assert info.value.key == key
    assert ("tensor (2) x pipeline (3)" in str(info.value)) == (tp > 1 and pp > 1)


@pytest.mark.parametrize("tp", [0, -2])
def test_tensor_parallel_must_be_positive(tp):
    with pytest.raises(ConfigError, match="tensor_parallel.autotp_size.*positive integer"):
        Config.load({TBS: 16, "tensor_parallel": {"autotp_size": tp}}, world_size=2)


def test_tensor_parallel_wrong_type():
    with pytest.raises(ConfigError, match="tensor_parallel.autotp_size.*expected an integer"):
        Config.load({TBS: 16, "tensor_parallel": {"autotp_size": "2"}}, world_size=2)
