"""DeepSpeedExamples' training/ scripts, the calls they make. tensor_parallel: the script builds its own
tensor- and data-parallel groups, hands them in as a Megatron-style mpu beside tensor_parallel.autotp_size
(and DeepSpeed's data_parallel_size key), passes the whole model with a client AdamW, and broadcasts each
step's random tokens over its tensor-parallel group. zerotron splits the model itself; the losses must
be those of the whole model trained by plain PyTorch on one process; hf_integration trains OPT (which
ships no tensor-parallel plan: zerotron's). offload_states: a ZeRO-3 model built
under zero.Init, offload_states / reload_states between steps with DeepSpeed's enums."""

from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from distributed import RankError, run_ranks
from hf_families import tiny_config
from parity import EPS, hf_loss, max_weight_diff, reference_training

import zerotron

STEPS, SEQ, LR = 3, 16, 1e-3


@dataclass
class _Mpu:  # the examples' ModelParallelUnit
    tp_group: object
    dp_group: object
    tp_size: int
    dp_size: int
    tp_rank: int
    dp_rank: int

    def get_model_parallel_group(self):
        return self.tp_group

    def get_data_parallel_group(self):
        return self.dp_group

    def get_model_parallel_world_size(self):
        return self.tp_size

    def get_data_parallel_world_size(self):
        return self.dp_size

    def get_model_parallel_rank(self):
        return self.tp_rank

    def get_data_parallel_rank(self):
        return self.dp_rank


def _model():
    model_cls, config = tiny_config("LlamaForCausalLM")
    torch.manual_seed(0)
    return model_cls(config)


def _tokens(vocab):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (1, SEQ), generator=g) for _ in range(STEPS)]


def _reference():
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for x in _tokens(model.config.vocab_size):
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # DeepSpeed's default gradient_clipping
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _autotp_example(mpu_groups="script"):
    """`mpu_groups`: "script" (the examples' mpu), "crossed" (its groups swapped), None (no mpu: the HF
    Trainer's way, tensor_parallel.autotp_size alone)."""
    rank = dist.get_rank()
    group = dist.new_group([0, 1])  # the script's groups: tensor 2 x data 1
    dp_group = [dist.new_group([r]) for r in range(2)][rank]
    mpu = _Mpu(*((dp_group, group) if mpu_groups == "crossed" else (group, dp_group)), 2, 1, rank, 0)
    model = _model()
    config = {
        "train_batch_size": 1,
        "train_micro_batch_size_per_gpu": 1,
        "zero_optimization": {"stage": 1},
        "tensor_parallel": {"autotp_size": 2},
        "data_parallel_size": 1,
    }
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    engine, *_ = zerotron.initialize(model=model, optimizer=optimizer, config=config, mpu=mpu if mpu_groups else None)
    losses = []
    for x in _tokens(model.config.vocab_size):
        x = x if mpu.tp_rank == 0 else torch.empty_like(x)
        dist.broadcast(x, src=0, group=group)
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


@pytest.mark.timeout(120)
def test_autotp_example_mpu_beside_autotp_size_trains_the_whole_model():
    want = _reference()
    for mpu_groups in ("script", None):
        for got in run_ranks(_autotp_example, 2, mpu_groups, timeout=90):
            assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(got, want)), (mpu_groups, got, want)
    # An mpu whose tensor-parallel group holds other ranks than zerotron's split (here the script's
    # groups crossed: its data-parallel group handed out as the model-parallel one) is refused by name.
    with pytest.raises(RankError, match=r"tensor-parallel group on rank \d is ranks \[\d\]"):
        run_ranks(_autotp_example, 2, "crossed", timeout=90)


def test_data_parallel_size_must_be_what_the_sizes_leave():
    zerotron.Config.load({"train_micro_batch_size_per_gpu": 1, "data_parallel_size": 2}, world_size=2)
    with pytest.raises(zerotron.ConfigError, match="data_parallel_size"):
        zerotron.Config.load({"train_micro_batch_size_per_gpu": 1, "data_parallel_size": 2}, world_size=4)


def _offload_states(offloads):
    import importlib

    enums = importlib.import_module("zerotron.compat.paths").PATHS["runtime.zero.offload_config"]
    enums = importlib.import_module(enums)
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Adam", "params": {"lr": 1e-2}}}
    config["zero_optimization"] = {"stage": 3}
    with zerotron.zero.Init(config_dict_or_path=config):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    engine, *_ = zerotron.initialize(model=model, model_parameters=model.parameters(), config=config)
    g = torch.Generator().manual_seed(dist.get_rank())
    losses = []
    for offload in offloads:
        x, y = torch.randn(1, 8, generator=g), torch.randint(0, 8, (1,), generator=g)
        loss = torch.nn.functional.cross_entropy(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        if offload:
            states = [enums.OffloadStateTypeEnum.optim_states]
            engine.offload_states(include=states, device=enums.OffloadDeviceEnum.cpu, pin_memory=True)
            engine.reload_states()
    try:
        engine.offload_states(include=[enums.OffloadStateTypeEnum.hp_params], device=enums.OffloadDeviceEnum.cpu)
        refused = None
    except NotImplementedError as e:
        refused = str(e)
    return losses, refused


@pytest.mark.timeout(60)
def test_offload_states_example_calls_with_deepspeeds_enums():
    (losses, refused), _ = run_ranks(_offload_states, 2, (False, True, True, False), timeout=45)
    (plain, _), _ = run_ranks(_offload_states, 2, (False,) * 4, timeout=45)
    assert losses == plain and len(set(plain)) == 4  # the states came back: training goes on as without
    assert "hp_params" in refused  # a kind zerotron does not move is refused by name


def _opt(split: bool):
    # GELU, not OPT's ReLU: a pre-activation within rounding of 0 switches a ReLU's gradient on or off, which
    # Adam turns into a whole step; the comparison is of the split, not of that amplification.
    model_cls, config = tiny_config("OPTForCausalLM", {"opt": {"activation_function": "gelu"}})
    torch.manual_seed(0)
    model = model_cls(config)
    batches = [(x, x) for x in _tokens(config.vocab_size)]
    if not split:
        return reference_training(batches, model=model, forward=hf_loss, lr=LR, weight_decay=0.0)
    adamw = {"lr": LR, "betas": [0.9, 0.95], "eps": EPS, "weight_decay": 0.0}
    config = {"train_micro_batch_size_per_gpu": 1, "tensor_parallel": {"autotp_size": 2}}
    config["optimizer"] = {"type": "AdamW", "params": adamw}
    engine, *_ = zerotron.initialize(model=model, config=config)
    losses = [engine.train_batch(iter([{"input_ids": x, "labels": x}])).item() for x, _ in batches]
    split_layers = sorted({n.split(".")[-2] for n, p in engine.module.named_parameters() if hasattr(p, "tp_split_dim")})
    return losses, zerotron.zero.consolidated_state_dict(engine.module), split_layers


@pytest.mark.timeout(60)
def test_opt_splits_under_autotp_as_the_hf_integration_example_asks():
    want, weights = _opt(split=False)
    losses, state, split_layers = run_ranks(_opt, 2, True, timeout=45)[0]
    assert split_layers == ["fc1", "fc2", "k_proj", "out_proj", "q_proj", "v_proj"]
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(losses, want)), (losses, want)
    assert max_weight_diff(state, weights) <= 1e-5


class _Plain:
    def __init__(self, net, optimizer):
        self.net, self.optimizer = net, optimizer

    def backward(self, loss):
        loss.backward()

    def step(self):
        torch.nn.utils.clip_grad_norm_(self.net.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad()


def _gan(world: int, stage: int = 0, freeze: bool = False):
    """gan_deepspeed_train.py's loop on tiny MLPs: two engines, each given its own client Adam beside the
    config's optimizer section; the discriminator called directly and backward twice before its step; the
    generator's loss backpropagating through the discriminator (`freeze`: with the discriminator's parameters
    frozen meanwhile); netD.zero_grad() each iteration. Each rank takes its half of every batch; `world` 0 is
    plain PyTorch on the whole batch."""
    torch.manual_seed(0)
    net_d = torch.nn.Sequential(
        torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1), torch.nn.Sigmoid(), torch.nn.Flatten(0)
    )
    net_g = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 6))
    opt_d = torch.optim.Adam(net_d.parameters(), lr=1e-2, betas=(0.5, 0.999))
    opt_g = torch.optim.Adam(net_g.parameters(), lr=1e-2, betas=(0.5, 0.999))
    rank, rows = (dist.get_rank(), 4) if world else (0, 8)
    if world:
        config = {"train_batch_size": 8, "optimizer": {"type": "Adam", "params": {"lr": 2e-4}}}
        config["zero_optimization"] = {"stage": stage}
        engine_d, opt_d, *_ = zerotron.initialize(model=net_d, optimizer=opt_d, config=config)
        engine_g, opt_g, *_ = zerotron.initialize(model=net_g, optimizer=opt_g, config=config)
    else:  # plain PyTorch on the whole batch: backward, and each step clipped as the engines' (gradient_clipping 1)
        engine_d, engine_g = _Plain(net_d, opt_d), _Plain(net_g, opt_g)
    bce, g = torch.nn.BCELoss(), torch.Generator().manual_seed(1)
    for _ in range(3):
        real, noise = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
        real, noise = real[rank * rows : (rank + 1) * rows], noise[rank * rows : (rank + 1) * rows]
        net_d.zero_grad()
        engine_d.backward(bce(net_d(real), torch.ones(rows)))
        fake = net_g(noise)
        engine_d.backward(bce(net_d(fake.detach()), torch.zeros(rows)))
        engine_d.step()
        net_g.zero_grad()
        net_d.requires_grad_(not freeze)
        engine_g.backward(bce(net_d(fake), torch.ones(rows)))
        net_d.requires_grad_(True)
        engine_g.step()
    weights = [*net_d.parameters(), *net_g.parameters()]
    with zerotron.zero.GatheredParameters(weights, enabled=stage == 3):
        return [p.detach().clone() for p in weights]


def _gan_every_stage(world: int):
    """Stages 0-2 as the script is; stage 3 refuses the generator's backward through the discriminator's
    parameters, and trains with them frozen meanwhile. DeepSpeed 0.19.8 (measured): stage 0 matches, stage 1
    is 0.051 off plain PyTorch (the two backward calls before the step), stage 2 asserts, stage 3 asserts and
    with the freeze is 0.051 off."""
    out = [_gan(world, stage) for stage in (0, 1, 2)] + [_gan(world, 3, freeze=True)]
    with pytest.raises(RuntimeError, match="another engine's loss through this model"):
        _gan(world, 3)
    _outside_gradients_are_not_stepped_unreduced()
    return out


def _outside_gradients_are_not_stepped_unreduced():
    """Gradients only another backward left (here the bare module's, no engine.backward) are never stepped
    unreduced: step() names them."""
    for stage in (0, 1, 2):
        model = torch.nn.Linear(4, 2)
        config = {"train_batch_size": 2, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
        engine, *_ = zerotron.initialize(model=model, config={**config, "zero_optimization": {"stage": stage}})
        model(torch.ones(1, 4)).sum().backward()
        with pytest.raises(RuntimeError, match="not reduced across ranks"):
            engine.step()


@pytest.mark.timeout(60)
def test_gan_example_two_engines_train_as_plain_pytorch_at_every_stage():
    want = _gan(0)
    for got in run_ranks(_gan_every_stage, 2, 2, timeout=50):
        for stage, weights in enumerate(got):
            assert max((a - b).abs().max().item() for a, b in zip(weights, want)) <= 1e-5, stage
