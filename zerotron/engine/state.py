"""The engine's state beyond the model: what it holds in memory, what a checkpoint keeps of it
(training_state / load_training_state, read and written by checkpoint/), its data position and
its communication counters. A mixin of engine.Engine."""

from __future__ import annotations

import os

import torch

from ..comm import Comm, comm_for
from ..errors import MisuseError
from ..log import warn
from ..parallelize.hf import is_hf_model


def tied_names(module: torch.nn.Module) -> dict[str, str]:
    """{alias: first name} for every parameter `module` reaches under more than one name."""
    first, tied = {}, {}
    for name, param in module.named_parameters(remove_duplicate=False):
        if id(param) in first:
            tied[name] = first[id(param)]
        else:
            first[id(param)] = name
    return tied


class EngineState:
    def start_at_boundary(self):
        """Stand at the start of a global batch after `global_steps` whole steps, with nothing
        accumulated: a loaded checkpoint holds whole steps, whatever accumulation (another
        data-parallel size changes it) it was saved under."""
        self.micro_steps = self.global_steps * self.gradient_accumulation_steps()
        self.states.zero_grads()
        self._take_record()

    def memory_report(self) -> dict[str, int]:
        """Bytes this rank holds for model states."""

        def nbytes(tensors):
            seen, total = set(), 0
            for t in tensors:
                if torch.is_tensor(t) and t.untyped_storage().data_ptr() not in seen:
                    seen.add(t.untyped_storage().data_ptr())
                    total += t.untyped_storage().nbytes()
            return total

        report = {
            "params": nbytes(self.module.parameters()),
            **self.states.memory(),
            "optimizer": nbytes(v for s in self.optimizer.state.values() for v in s.values()),
        }
        host = report.pop("host", None)
        report["total"] = sum(report.values())
        if host is not None:  # offloaded: what of the above lives in host memory
            report["host"] = host + (report["optimizer"] if self.states.host is not None else 0)
        return report

    def predicted_memory(self) -> dict[str, int]:
        """The planner's model-state bytes for this rank (zerotron.planner.memory), from the
        parameters it trains and the configured ZeRO stage, precision and offload."""
        from ..planner.memory import rank_state_bytes

        z = self.config.zero_optimization
        total = {}
        for size, numels in self._param_numels.items():  # per shard group: dense, experts
            part = rank_state_bytes(
                numels,
                dp=size,
                stage=z.stage,
                dtype={torch.float32: "fp32", torch.bfloat16: "bf16"}.get(self.dtype, "fp16"),
                offload_optimizer=z.offload_optimizer is not None and z.offload_optimizer.device == "cpu",
                offload_param=z.offload_param is not None and z.offload_param.device == "cpu",
                persistence_threshold=z.stage3_param_persistence_threshold,
            )
            total = {k: total.get(k, 0) + v for k, v in part.items()}
        return total

    # ---- checkpoints (zerotron/checkpoint/) -------------------------------------------------------
    def training_state(self) -> dict:
        """What a checkpoint keeps of this engine besides the tensors: layout, counters, loss
        scaler, scheduler, optimizer hyperparameters, data position and the model's metadata."""
        return {
            "topology": {
                "dp": self.topology.dp,
                "sp": self.topology.sp,
                "cp": self.topology.cp,
                "tp": self.topology.tp,
                "pp": self.topology.pp,
            },
            "zero_stage": self.zero_optimization_stage(),
            "dtype": self.config.model_dtype_name,
            "counters": {
                "global_steps": self.global_steps,
                "global_samples": self.global_samples,
                "skipped_steps": self.skipped_steps,
            },
            "loss_scaler": self.loss_scaler.state_dict(),
            "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None,
            "optimizer_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups],
            "data": self.data_state(),
            # A Transformers model's config, so `zerotron convert` can write a Hugging Face directory.
            "hf_config": self.module.config.to_dict() if is_hf_model(self.module) else None,
            # Names of weights tied to another parameter -> the name they are saved under, so that a state
            # dict made from the checkpoint (zero_to_fp32) loads into the model with strict=True.
            "tied": tied_names(self.module),
        }

    def load_training_state(self, state: dict, load_lr_scheduler_states: bool = True) -> None:
        """Counters, loss scaler, scheduler and data position from `training_state()`'s dict; the
        engine then stands at the start of the next global batch."""
        if load_lr_scheduler_states and self.lr_scheduler is not None and state["lr_scheduler"] is not None:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        self.loss_scaler.load_state_dict(state["loss_scaler"])
        for k in ("global_steps", "global_samples", "skipped_steps"):
            setattr(self, k, state["counters"][k])
        self.start_at_boundary()
        self.load_data_state(state.get("data"))

    def save_checkpoint(
        self, save_dir, tag=None, client_state=None, save_latest: bool = True, exclude_frozen_parameters: bool = False
    ) -> bool:
        """Every rank writes its own shard (safetensors + JSON), atomically; see checkpoint/save.py.
        `exclude_frozen_parameters` (DeepSpeed's) is accepted; frozen parameters are still written
        (a larger checkpoint, nothing lost)."""
        from ..checkpoint.save import save_checkpoint

        if save_dir is None or str(save_dir) == "":
            raise ValueError("save_checkpoint(save_dir=...): give the directory to save in (it is empty)")
        save_dir, tag = self._agreed_place(
            str(save_dir), str(tag if tag is not None else f"global_step{self.global_steps}")
        )
        return save_checkpoint(self, save_dir, tag, client_state, save_latest)

    def _agreed_place(self, save_dir: str, tag: str) -> tuple[str, str]:
        """The directory and tag every rank saves under. All ranks write one checkpoint, so they must agree.
        The directory: rank 0's, with a warning naming the others' (DeepSpeedExamples' HelloDeepSpeed names its
        run directory by each rank's clock, a second apart at times: DeepSpeed then writes rank 1's files into a
        directory of their own, and neither is a whole checkpoint). The tag: checked against the others' by the
        config's checkpoint.tag_validation: with different tags Fail raises (an AssertionError, as DeepSpeed's),
        Warn says so and Ignore does not, and both save under rank 0's tag."""
        gathered = comm_for(None, "world").all_gather_object((os.path.abspath(save_dir), tag))
        dirs, tags = [d for d, _ in gathered], [t for _, t in gathered]
        if len(set(dirs)) > 1:
            listed = ", ".join(f"rank {r}: {d}" for r, d in enumerate(dirs))
            warn(f"save_checkpoint: save_dir differs across ranks ({listed}); saving every rank's files under rank 0's")
        save_dir = save_dir if len(set(dirs)) == 1 else dirs[0]
        if len(set(tags)) == 1:
            return save_dir, tag
        mode = self.config.checkpoint.tag_validation_mode
        differ = f"checkpoint tags differ across ranks ({', '.join(f'rank {r}: {t!r}' for r, t in enumerate(tags))})"
        if mode == "FAIL":
            raise MisuseError(f"save_checkpoint: {differ}; pass every rank the same tag (checkpoint.tag_validation)")
        if mode == "WARN":
            warn(f"save_checkpoint: {differ}; saving under rank 0's {tags[0]!r} (checkpoint.tag_validation: Warn)")
        return save_dir, tags[0]

    def load_checkpoint(
        self,
        load_dir,
        tag=None,
        load_module_strict: bool = True,
        load_optimizer_states: bool = True,
        load_lr_scheduler_states: bool = True,
        load_module_only: bool = False,
        custom_load_fn=None,
    ):
        """Load a checkpoint written under any topology; returns (path, client_state), or
        (None, None) when `load_dir` has no `latest` and no tag is given. DeepSpeed's signature
        and argument order; `load_module_strict=False` keeps the current values of parameters the
        checkpoint lacks (strict: an error naming them). `custom_load_fn` is refused."""
        if custom_load_fn is not None:
            raise NotImplementedError(
                "load_checkpoint(custom_load_fn=...) is not supported by zerotron: checkpoints "
                "are read by zerotron.checkpoint (any layout, any topology); leave it out"
            )
        from ..checkpoint.load import load_checkpoint

        return load_checkpoint(
            self,
            load_dir,
            tag,
            load_optimizer_states,
            load_lr_scheduler_states,
            load_module_only,
            load_module_strict=load_module_strict,
        )

    def save_16bit_model(self, save_dir, save_filename: str = "model.safetensors") -> bool:
        """The whole model's weights in the model dtype, one safetensors file written by rank 0."""
        from ..checkpoint.export import save_16bit_model

        return save_16bit_model(self, save_dir, save_filename)

    def data_state(self) -> dict | None:
        """Where the engine's own dataloader is (for exact resume)."""
        if self.training_dataloader is None:
            return None
        return {"sampler": self.training_dataloader.sampler.state_dict()}

    def load_data_state(self, state: dict | None):
        if state is not None and self.training_dataloader is not None:
            self.training_dataloader.sampler.load_state_dict(state["sampler"])
            self._data_iter = None  # the next train_batch starts from the restored position

    def comm_stats(self) -> dict[str, int]:
        """Bytes of the full tensors each kind of collective moved since start or the last reset."""
        return {k: sum(c.stats()[k] for c in self._comms()) for k in Comm.KINDS}

    def reset_comm_stats(self):
        for c in self._comms():
            c.reset_stats()

    def _comms(self) -> list[Comm]:
        sequence = [comm_for(self.topology.group(d), d) for d in ("sp", "cp") if getattr(self.topology, d) > 1]
        experts = self.shard_groups.expert
        experts = [comm_for(self.topology.group("ep"), "ep"), experts.reduce, experts.gather] if experts else []
        return [self.dp_comm, self.grad_comm, self.tp_comm, self.world_comm] + sequence + experts
