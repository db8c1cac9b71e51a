"""The training engine: forward / backward / step / train_batch on one model replica per rank."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn as nn

from .. import preemption, watchdog
from ..comm import Comm, comm_for, local_device
from ..config import Config
from ..errors import BadBatchError, MisuseError
from ..log import warn
from ..moe.expert_groups import shard_groups
from ..monitor import Monitor
from ..nested import tensors_in, to_device
from ..optim import build_optimizer
from ..optim.build import check_client_on_host
from ..parallelize import parallelize, vocab_size
from ..precision import LossScaler, cast_module, model_dtype
from ..topology import Topology
from ..zero import make_model_states
from ..zero.partition_api import built_under_init, refuse_foreign_partitions
from ..zero.unused import unused_parameter_check
from .accessors import EngineAccessors, ThroughputTimer
from .direct_backward import refuse_direct_backward
from .input_guard import InputGuard
from .report import StepReport
from .state import EngineState
from .step import StepStages


class _NoOptimizer(torch.optim.SGD):
    """The optimizer of an engine built without one (DeepSpeed's initialize without an optimizer,
    for inference/evaluation): no state, lr 0; the engine refuses to step with it."""

    placeholder = True  # engine/step.py: refuses to step with it

    def __init__(self, params):
        super().__init__(params, lr=0.0)


class Engine(StepStages, EngineState, EngineAccessors, nn.Module):
    """What `zerotron.initialize` returns; DeepSpeed's engine API.

    Gradients accumulate over `gradient_accumulation_steps` micro-batches without communication;
    in the boundary micro-batch's backward they are all-reduced bucket by bucket as they become
    ready, and `step()` then unscales, clips, updates the fp32 masters and copies them back.
    """

    shuffles_data = True  # the loader built from training_data: shuffled, as DeepSpeed's engine's

    def __init__(
        self,
        module: nn.Module,
        config: Config,
        topology: Topology,
        optimizer=None,
        lr_scheduler=None,
        model_parameters=None,
        training_data=None,
        collate_fn=None,
        isolate=None,
    ):
        """`isolate(module)`, given the placed and split model, returns parameter lists that need
        gradient buckets of their own (the pipeline engine's weights tied across stages)."""
        super().__init__()
        self.config = config
        self.topology = topology
        self.device = local_device()
        self.global_rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.local_rank = int(__import__("os").environ.get("LOCAL_RANK", 0))
        self.coords = topology.coords(self.global_rank)
        self.dtype = model_dtype(config)
        # A model to split stays where it was built until it is split: the whole of a model that
        # needs tensor parallelism may not fit the device (parallelize places the shards).
        self.module = self._place(module, self.device if topology.tp == 1 else None)

        self.dp_comm = Comm(topology.group("dp"), "dp")
        self.grad_comm = Comm(topology.group("dp_grad"), "dp_grad")  # gradient reductions (see zero/sharded.py)
        self.tp_comm = Comm(topology.group("tp"), "tp")
        self.world_comm = comm_for(None, "world")
        parallelize(self.module, config, topology, self.tp_comm, self.device)  # tensor parallelism, checkpointing
        self.shard_groups = shard_groups(self.module, topology, self.grad_comm, self.dp_comm)  # experts': theirs
        self._broadcast_module()
        params = [p for p in self.module.parameters() if p.requires_grad]
        if not params:
            raise ValueError("the model has no parameters that require gradients; nothing to train")
        self._param_numels = {}  # shard group size -> numels, before ZeRO-3 partitions them (memory prediction)
        for p in params:
            self._param_numels.setdefault(self.shard_groups.of(p).size, []).append(getattr(p, "ds_numel", p.numel()))
        self._backward_owner = None  # "engine" inside engine.backward, "autograd" inside a direct loss.backward()
        self._grad_hooks = (
            [p.register_hook(self._scale_direct_grad) for p in params] if config.gradient_accumulation_steps > 1 else []
        )
        self.optimizer = self._make_optimizer(optimizer, model_parameters, params)
        # Gradient reduction, master weights and parameter updates, for the configured ZeRO stage.
        self.states = make_model_states(
            self.module,
            self.optimizer,
            config,
            self.shard_groups,
            isolate=isolate(self.module) if isolate is not None else [],
        )
        self._unused_check = unused_parameter_check(self.module, config)  # verified at each step
        self.lr_scheduler = self._make_scheduler(lr_scheduler)
        self.loss_scaler = LossScaler(config.fp16)
        self.monitor = Monitor(config, self.global_rank)
        self.training_dataloader = self._make_dataloader(training_data, collate_fn)
        self._data_iter = None

        self.global_steps = 0
        self.global_samples = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        self._global_grad_norm = None
        self._nonfinite_streak = 0
        self.preemption_requested = False
        if config.zerotron.save_on_preemption:
            preemption.install()
        watchdog.configure(config.zerotron.collective_timeout, config.zerotron.collective_checks)
        self.input_guard = InputGuard(vocab_size(self.module))
        self._take_record()  # what this step gathers over its micro-batches
        self._boundary_override: bool | None = None
        self.reporter = StepReport(self)  # (and the flops profiler, when the config enables it)
        self._created_at = time.perf_counter()  # (compat/utils/engines.py orders engines it finds by it)
        self._step_applied = False
        self._inside_no_sync = False
        self._offloaded_from = None  # offload_states: the devices the optimizer states came from
        self.tput_timer = ThroughputTimer(config.train_batch_size)
        self.reset_comm_stats()  # count training traffic only

    # ---- construction helpers ---------------------------------------------------------------
    def _place(self, module: nn.Module, device: torch.device | None) -> nn.Module:
        """Cast the model to the training dtype and move it to `device` (None: where it is);
        parameters built under zero.Init stay partitioned (placeholders plus this rank's pieces)
        until ZeRO-3 builds its units from them."""
        refuse_foreign_partitions(module)
        meta = any(p.is_meta or built_under_init(p) for p in module.parameters())
        if meta and self.config.zero_optimization.stage != 3:
            raise ValueError(
                "the model was built under zerotron.zero.Init (partitioned parameters), which needs "
                "zero_optimization.stage 3"
            )
        if meta and self.topology.tp > 1:
            raise ValueError(
                "zerotron.zero.Init with tensor parallelism is not supported yet: build the model "
                "normally (tensor parallelism already splits it) or use tensor_parallel.autotp_size 1"
            )
        return cast_module(module, self.dtype, device)

    def _broadcast_module(self):
        """Start every replica (data and sequence ranks) from the first one's weights, seeded or not
        (an expert from the first rank holding it)."""
        for t in list(self.module.parameters()) + list(self.module.buffers()):
            comm = self.shard_groups.of(t).gather
            if comm.size > 1 and not t.is_meta and not built_under_init(t):  # zero.Init pieces agree already
                comm.broadcast(t.data, src_group_rank=0)

    def _make_optimizer(self, client, model_parameters, params):
        if client is not None and self.config.optimizer is not None:  # DeepSpeed trains with the client's too
            warn(
                f"the config's optimizer section ({self.config.optimizer.type}) is ignored: initialize(optimizer=...) "
                "gave one, which trains the model (as in DeepSpeed); remove the section or the argument"
            )
        groups = list(model_parameters) if model_parameters is not None else params
        if client is None:
            if self.config.optimizer is None:
                # DeepSpeed builds an engine without an optimizer for inference and evaluation (the
                # Trainer's evaluate() before train()): forward works, step() says what is missing.
                return _NoOptimizer(groups)
            off = self.config.zero_optimization.offload_optimizer
            return build_optimizer(
                self.config.optimizer.type,
                self.config.optimizer.params,
                groups,
                on_host=off is not None and off.device == "cpu",
            )
        if isinstance(client, torch.optim.Optimizer) or callable(client):
            built = client if isinstance(client, torch.optim.Optimizer) else client(groups)
            return check_client_on_host(built, self.config)
        raise TypeError(f"optimizer must be a torch.optim.Optimizer or a callable, not {type(client).__name__}")

    def _make_scheduler(self, client):
        if client is not None:
            return client(self.optimizer) if callable(client) and not hasattr(client, "step") else client
        if self.config.scheduler is None:
            return None
        from ..schedulers import build_scheduler

        return build_scheduler(self.config.scheduler.type, self.config.scheduler.params, self.optimizer)

    def _make_dataloader(self, dataset, collate_fn):
        if dataset is None:
            return None
        from ..data import ResumableDistributedSampler

        if len(dataset) < self.train_batch_size():
            raise ValueError(
                f"training_data holds {len(dataset)} samples, fewer than one global batch "
                f"({self.train_batch_size()} = micro-batch x accumulation x data-parallel ranks): "
                "use more data or a smaller batch"
            )
        sampler = ResumableDistributedSampler(
            len(dataset), num_replicas=self.topology.dp, rank=self.coords.dp, shuffle=self.shuffles_data, infinite=False
        )
        return torch.utils.data.DataLoader(
            dataset,
            batch_size=self.train_micro_batch_size_per_gpu(),
            sampler=sampler,
            collate_fn=collate_fn or _collate,
            drop_last=True,
        )

    # ---- the training verbs -----------------------------------------------------------------
    def forward(self, *args, **kwargs):
        if self.__dict__.get("_destroyed"):
            raise RuntimeError(
                "this engine was destroyed (engine.destroy(); accelerate's free_memory() calls it when Trainer.train() "
                "starts) and its ZeRO state is gone: build a new one with zerotron.initialize. The Hugging Face "
                "Trainer "
                "reuses the engine of an evaluate() run before train(), with DeepSpeed too "
                "(huggingface/transformers#44889): "
                "evaluate at the start of training with TrainingArguments(eval_on_start=True), or train with a new "
                "Trainer"
            )
        self.tput_timer.start()
        args, kwargs = self.input_guard.check(
            args, kwargs, self._record, f"step {self.global_steps} on rank {self.global_rank}"
        )
        output = self.module(*args, **kwargs)
        if torch.is_grad_enabled():  # a script may call loss.backward() itself instead of engine.backward
            for t in tensors_in(output):
                if t.requires_grad:
                    t.register_hook(self._on_output_grad)
        return output

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True):
        """Backpropagate one micro-batch's loss; at the accumulation boundary, reduce gradients.
        Returns the loss divided by the accumulation steps (as DeepSpeed)."""
        if not torch.is_tensor(loss) or loss.numel() != 1:
            raise ValueError("engine.backward expects the scalar loss tensor of one micro-batch")
        boundary = self.is_gradient_accumulation_boundary()
        self._record.add_loss(loss)
        gas_scaled = loss / self.gradient_accumulation_steps() if scale_wrt_gas else loss
        scaled = gas_scaled.float() * self.loss_scaler.scale if self.loss_scaler.enabled else gas_scaled.float()
        self.states.begin_backward(boundary and not self._inside_no_sync)
        self._backward_owner = "engine"
        try:
            scaled.backward(retain_graph=retain_graph)
        finally:
            self._backward_owner = None
        self.states.end_backward()
        return gas_scaled.detach()

    # `loss.backward()` without engine.backward (as DeepSpeed allows): the first gradient reaching
    # one of the engine's outputs opens the backward, each parameter's incoming gradient is divided
    # by the accumulation steps (as engine.backward divides the loss), and a callback autograd runs
    # when the backward ends closes it: the same reductions, the same weights.
    def _on_output_grad(self, grad):
        if self._backward_owner is not None:
            return None
        refuse_direct_backward(self)
        self._backward_owner = "autograd"
        self.states.begin_backward(self.is_gradient_accumulation_boundary() and not self._inside_no_sync)
        torch.autograd.Variable._execution_engine.queue_callback(self._end_direct_backward)
        return None

    def _end_direct_backward(self):
        self._backward_owner = None
        self.states.end_backward()

    def _scale_direct_grad(self, grad):
        return grad / self.gradient_accumulation_steps() if self._backward_owner == "autograd" else None

    def step(self, lr_kwargs: dict | None = None):
        """Count a micro-batch; at the accumulation boundary, update the weights."""
        if self._inside_no_sync:
            raise MisuseError("It is illegal to call Engine.step() inside no_sync context manager: leave it first")
        boundary = self.is_gradient_accumulation_boundary()
        self._step_applied = False
        if boundary:
            self.optimizer_step(lr_kwargs)
        self.micro_steps += 1
        self.tput_timer.stop(global_step=boundary)

    def train_batch(self, data_iter=None) -> torch.Tensor:
        """One global batch: all micro-batches, reduction and step. Returns the mean loss (all ranks)."""
        it = self._iterator(data_iter)
        losses = []
        for _ in range(self.gradient_accumulation_steps()):
            loss = self._loss_of(self.forward_batch(next(it)))
            self.backward(loss)
            self.step()
            losses.append(loss.detach().float())
        return self._mean_over_dp(torch.stack(losses).mean())

    @torch.no_grad()
    def eval_batch(self, data_iter=None, num_micro_batches: int | None = None) -> torch.Tensor:
        """Mean loss over one global batch (or `num_micro_batches`) without touching gradients or weights."""
        it = self._iterator(data_iter)
        was_training = self.module.training
        self.module.eval()
        try:
            losses = [
                self._loss_of(self.forward_batch(next(it))).float()
                for _ in range(num_micro_batches or self.gradient_accumulation_steps())
            ]
        finally:
            self.module.train(was_training)
        return self._mean_over_dp(torch.stack(losses).mean())

    def forward_batch(self, batch):
        """Call the model on a batch: a tuple/list is unpacked, a dict passed as keywords."""
        batch = to_device(batch, self.device)
        if isinstance(batch, (list, tuple)):
            return self(*batch)
        if isinstance(batch, dict):
            return self(**batch)
        return self(batch)

    def _iterator(self, data_iter):
        if data_iter is not None:
            return data_iter
        if self._data_iter is None:  # (set_dataiterator sets it)
            if self.training_dataloader is None:
                raise ValueError("train_batch needs a data iterator, or training_data given to zerotron.initialize")
            self._data_iter = _RepeatingIterator(self.training_dataloader, self.training_dataloader.sampler.epoch)
        return self._data_iter

    @staticmethod
    def _loss_of(output) -> torch.Tensor:
        if torch.is_tensor(output):
            return output
        if hasattr(output, "loss") and output.loss is not None:
            return output.loss
        if isinstance(output, (tuple, list)) and output and torch.is_tensor(output[0]):
            return output[0]
        raise ValueError("the model's output has no loss: return the loss tensor (or an object with .loss)")

    def _mean_over_dp(self, value: torch.Tensor) -> torch.Tensor:
        """The mean over the replicas (a sequence rank's loss is the full sequence's: the same)."""
        if self.dp_comm.size > 1:
            value = value.clone()
            self.dp_comm.all_reduce(value)
            value /= self.dp_comm.size
        return value

    def zero_grad(self, set_to_none: bool = True):
        self.states.zero_grads()


class _RepeatingIterator:
    """Cycles a DataLoader over epochs (advancing the sampler's epoch) for train_batch()."""

    def __init__(self, loader, epoch: int = 0):
        self.loader, self.epoch = loader, epoch
        self.it = iter(loader)

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self.it)
        except StopIteration:
            self.epoch += 1
            if hasattr(self.loader.sampler, "set_epoch"):
                self.loader.sampler.set_epoch(self.epoch)
            self.it = iter(self.loader)
            return next(self.it)


def _collate(samples):
    """torch's default collation, with ragged samples named instead of a bare stack error."""
    try:
        return torch.utils.data.default_collate(samples)
    except RuntimeError as e:
        if "equal size" not in str(e) and "same size" not in str(e):
            raise
        shapes = sorted(
            {
                tuple(getattr(t, "shape", ()))
                for s in samples
                for t in (s if isinstance(s, (tuple, list)) else s.values() if isinstance(s, dict) else [s])
            }
        )
        raise BadBatchError(
            f"samples of different shapes cannot form one batch ({', '.join(map(str, shapes[:4]))}"
            f"{' ...' if len(shapes) > 4 else ''}): pad or cut them to one length, or pass a "
            "collate_fn that does (e.g. transformers.DataCollatorForLanguageModeling)"
        ) from e
