"""The engine's DeepSpeed-shaped accessors and conveniences: what scripts read and call besides
the training verbs (batch sizes, precision flags, the optimizer's name, groups, `no_sync`,
moving optimizer states off the device, passing attributes through to the model)."""

from __future__ import annotations

import contextlib
import time

import torch

from ..errors import MisuseError


class ThroughputTimer:
    """DeepSpeed's `engine.tput_timer`: samples per second over the steps since the first one
    (host wall time between optimizer steps, so no device sync is added to the step)."""

    def __init__(self, batch_size: int):
        self.batch_size = batch_size
        self.global_step_count = 0
        self.micro_step_count = 0
        self.epoch_count = 0
        self.total_elapsed_time = 0.0
        self.step_elapsed_time = 0.0
        self._started = None
        self._last = None

    def start(self):
        if self._started is None:
            self._started = time.perf_counter()

    def stop(self, global_step: bool = False, report_speed: bool = True):
        self.micro_step_count += 1
        if not global_step:
            return
        now = time.perf_counter()
        self.global_step_count += 1
        if self._last is not None:  # the first step (warm-up, compilation) is not counted
            self.step_elapsed_time = now - self._last
            self.total_elapsed_time += self.step_elapsed_time
        self._last = now

    def update_epoch_count(self):
        """A new epoch (DeepSpeed-Chat calls it at each): counted, and the micro-steps counted anew."""
        self.epoch_count += 1
        self.micro_step_count = 0

    def avg_samples_per_sec(self) -> float:
        counted = self.global_step_count - 1
        return self.batch_size * counted / self.total_elapsed_time if counted > 0 and self.total_elapsed_time else 0.0


class EngineAccessors:
    """Mixed into Engine (engine/engine.py): reads its config, topology, states and optimizer."""

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def train_batch_size(self) -> int:
        return self.config.train_batch_size

    def steps_per_print(self):
        return self.config.steps_per_print

    def wall_clock_breakdown(self) -> bool:
        return self.config.wall_clock_breakdown

    def is_gradient_accumulation_boundary(self) -> bool:
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool):
        """Override the boundary (as DeepSpeed): False for the accumulating backwards, True for the
        last one; then one engine.step() updates the weights."""
        self._boundary_override = bool(is_boundary)

    def zero_optimization_stage(self) -> int:
        return self.config.zero_optimization.stage

    def fp16_enabled(self) -> bool:
        return self.config.fp16.enabled

    def bf16_enabled(self) -> bool:
        return self.config.bf16.enabled

    def get_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        """The gradient norm of the last step before clipping; None when gradient_clipping is 0."""
        return None if self._global_grad_norm is None else float(self._global_grad_norm)

    @property
    def dp_world_size(self) -> int:
        return self.topology.dp

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.scale

    def bfloat16_enabled(self) -> bool:
        return self.config.bf16.enabled

    def optimizer_name(self) -> str | None:
        """The config's optimizer type, or the class name of the optimizer the script passed."""
        if self.config.optimizer is not None:
            return self.config.optimizer.type
        return type(self.optimizer).__name__

    def was_step_applied(self) -> bool:
        """Whether the last step() updated the weights (False between accumulation boundaries and
        for a skipped overflow step)."""
        return self._step_applied

    @property
    def data_parallel_group(self):
        return self.dp_comm.group

    @property
    def mp_world_size(self) -> int:
        return self.topology.tp

    @contextlib.contextmanager
    def no_sync(self):
        """Backwards inside accumulate their gradients locally, without reducing them (DeepSpeed's
        rules: not with ZeRO 2/3, whose gradients are partitioned as they are reduced; step() is
        illegal inside; no re-entry). The next backward outside reduces everything accumulated."""
        stage = self.zero_optimization_stage()
        if stage >= 2:  # the phrases DeepSpeed's refusals share, which callers match on
            raise MisuseError(
                f"engine.no_sync(): the no_sync context manager is incompatible with ZeRO stage {stage}, which "
                "partitions gradients as it reduces them: accumulate with gradient_accumulation_steps instead"
            )
        if self._inside_no_sync:
            raise MisuseError("engine.no_sync(): no_sync context manager reentry is unsupported; leave the outer block")
        self._inside_no_sync = True
        try:
            yield
        finally:
            self._inside_no_sync = False

    @property
    def sparse_tensor_module_names(self) -> set:
        """DeepSpeed's: the modules whose gradients it all-reduces as sparse tensors (`sparse_gradients`). zerotron
        reduces every gradient dense (the same values), so none; checkpoint comparisons read the set."""
        return set()

    def empty_partition_cache(self):
        """DeepSpeed's: release every ZeRO-3 parameter still gathered (the persistent ones stay) and hand cached
        device memory back; at stages 0-2 there is nothing gathered to release. The next forward gathers again."""
        release_all = getattr(self.states, "release_all", None)
        if release_all is not None:
            release_all()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    # DeepSpeed's offload_states/reload_states (RLHF loops free device memory between training and
    # generation). zerotron moves the optimizer states; the other kinds DeepSpeed names are refused.
    OFFLOADABLE = ("optim_states",)

    def offload_states(self, include=None, device="cpu", pin_memory: bool = True, non_blocking: bool = False):
        kinds = [getattr(k, "value", k) for k in (include or self.OFFLOADABLE)]
        unknown = [k for k in kinds if k not in self.OFFLOADABLE]
        if unknown or str(getattr(device, "value", device)) != "cpu":
            raise NotImplementedError(
                f"offload_states moves {list(self.OFFLOADABLE)} to 'cpu'; not {unknown or device}"
            )
        if self._offloaded_from is not None:
            return
        self._offloaded_from = {}
        for state in self.optimizer.state.values():
            for key, value in state.items():
                if torch.is_tensor(value) and value.device.type != "cpu":
                    host = torch.empty(
                        value.shape,
                        dtype=value.dtype,
                        device="cpu",
                        pin_memory=pin_memory and torch.cuda.is_available(),
                    )
                    host.copy_(value, non_blocking=non_blocking)
                    self._offloaded_from[id(host)] = value.device
                    state[key] = host
        if not self._offloaded_from and not non_blocking:
            self._offloaded_from = {"": None}  # nothing lived on a device (a CPU run): reload is a no-op

    def reload_states(self, non_blocking: bool = False):
        if self._offloaded_from is None:
            return
        for state in self.optimizer.state.values():
            for key, value in state.items():
                device = self._offloaded_from.get(id(value)) if torch.is_tensor(value) else None
                if device is not None:
                    state[key] = value.to(device, non_blocking=non_blocking)
        self._offloaded_from = None

    # ---- DeepSpeed's full-weight accessors (accelerate's get_state_dict, Trainer.save_model) ------
    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """Whether saving the model gathers the full weights (DeepSpeed's
        `stage3_gather_16bit_weights_on_model_save`, or its old fp16 name). Below ZeRO-3 with
        tensor parallelism zerotron can always consolidate, so it says True there."""
        zero = self.config.zero_optimization
        if zero.stage3_gather_16bit_weights_on_model_save:
            return True
        return zero.stage < 3 and self.config.tensor_parallel.autotp_size > 1

    def _consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict:
        """The whole model's state dict in the model dtype, in host memory, on global rank 0 (an
        empty dict elsewhere, as DeepSpeed; every rank must call it): checkpoint.export.whole_state_dict."""
        from ..checkpoint.export import whole_state_dict

        return whole_state_dict(self, exclude_frozen_parameters)

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict:
        """DeepSpeed's ZeRO-3 name for `_consolidated_16bit_state_dict` (any stage works here)."""
        return self._consolidated_16bit_state_dict(exclude_frozen_parameters)

    def compile(self, backend=None, compile_kwargs: dict | None = None, schedule=None, **kwargs):
        """DeepSpeed's `engine.compile()`: torch.compile the wrapped module in place
        (`nn.Module.compile`), so the engine's hooks (ZeRO-3 gathers, gradient reduction) stay on
        its submodules. `schedule` (DeepCompile's passes) is refused."""
        if schedule is not None:
            raise NotImplementedError(
                "engine.compile(schedule=...) is DeepSpeed's DeepCompile; zerotron compiles "
                "the module with torch.compile only: leave schedule out"
            )
        options = dict(compile_kwargs or {})
        options.update(kwargs)
        if backend is not None:
            options["backend"] = backend
        self.module.compile(**options)
        self._is_compiled = True

    @property
    def is_compiled(self) -> bool:
        return self.__dict__.get("_is_compiled", False)

    # ---- where train_batch() reads when it is given no iterator (DeepSpeed's PipelineEngine's setters) ------
    def set_dataiterator(self, iterator):
        """train_batch() / eval_batch() without an argument read `iterator` from now on (instead of the loader
        built from training_data, which is dropped, as DeepSpeed drops it)."""
        self.training_dataloader = None
        self._data_iter = iterator

    def set_dataloader(self, loader):
        """train_batch() without an argument reads `loader` from its start (once through: wrap it in
        RepeatingLoader to go on)."""
        self.training_dataloader = None
        self._data_iter = iter(loader)

    def destroy(self):
        """Detach the engine from the model: its hooks are removed (the model's own hooks stay),
        ZeRO-3 parameters are left released and the optimizer's states are dropped."""
        self.states.destroy()
        for h in self._grad_hooks:
            h.remove()
        self.optimizer.state.clear()
        self._destroyed = True

    def __getattr__(self, name: str):
        """Attributes the engine lacks come from the wrapped model, as in DeepSpeed
        (`engine.config` of a Transformers model is the engine's; `engine.generate` is the model's)."""
        try:
            return super().__getattr__(name)  # nn.Module: parameters, buffers, submodules
        except AttributeError:
            modules = self.__dict__.get("_modules", {})
            if "module" in modules and name != "module":
                return getattr(modules["module"], name)
            raise
