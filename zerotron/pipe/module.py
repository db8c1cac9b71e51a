"""PipelineModule: a model written as a flat list of layers, of which each rank builds only its part.

    layers = [LayerSpec(Embedding, cfg), *[LayerSpec(Block, cfg) for _ in range(n)], LayerSpec(Head, cfg)]
    model = PipelineModule(layers, num_stages=4, loss_fn=cross_entropy, partition_method="parameters")

As DeepSpeed's: each layer takes the previous layer's output (a tensor or a tuple of tensors) as
its one argument; the first gets the batch's inputs and `loss_fn(output, labels)` the last
output. `LayerSpec` delays building a layer until the partition says this rank owns it.
`TiedLayerSpec` layers with the same key share one module on every stage that uses them (an
input embedding reused as the output head); the engine keeps their copies equal and sums their
gradients across those stages.

zerotron adds `num_virtual_stages`: with v > 1 the layers are cut into stages × v parts and rank s
holds parts s, s + stages, …, which the interleaved 1F1B schedule runs.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.nn as nn

from .partition import partition_layers


class LayerSpec:
    """A layer to build later: `typename(*args, **kwargs)` runs only on the stage that owns it."""

    def __init__(self, typename, *args, **kwargs):
        if not callable(typename):
            raise TypeError(f"LayerSpec needs a module class (or a function returning a module), not {typename!r}")
        self.typename, self.args, self.kwargs = typename, args, kwargs

    def build(self) -> nn.Module:
        return self.typename(*self.args, **self.kwargs)

    @property
    def name(self) -> str:
        return getattr(self.typename, "__name__", type(self.typename).__name__)

    def __repr__(self):
        return f"LayerSpec({self.name})"


class TiedLayerSpec(LayerSpec):
    """A layer whose module is shared by every position with the same `key`. `forward_fn(module, x)`
    lets a position use the module differently (the head reusing the embedding's weight);
    `tied_weight_attr` names the shared parameter(s), as in DeepSpeed."""

    def __init__(self, key: str, typename, *args, forward_fn=None, tied_weight_attr="weight", **kwargs):
        super().__init__(typename, *args, **kwargs)
        self.key, self.forward_fn = key, forward_fn
        self.tied_weight_attr = [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)


class PipelineModule(nn.Module):
    def __init__(
        self,
        layers,
        num_stages: int | None = None,
        topology=None,
        loss_fn=None,
        seed_layers: bool = False,
        seed_fn=None,
        base_seed: int = 1234,
        partition_method: str = "parameters",
        activation_checkpoint_interval: int = 0,
        activation_checkpoint_func=None,
        checkpointable_layers=None,
        num_virtual_stages: int = 1,
        tensor_parallel_plan=None,
        stage_id: int | None = None,
        source_module: nn.Module | None = None,
    ):
        super().__init__()
        if topology is not None:
            num_stages = getattr(topology, "pp", None) or topology.get_dim("pipe")
        if num_stages is None or num_stages < 1:
            raise ValueError("PipelineModule needs num_stages (a positive integer) or a topology")
        if num_virtual_stages < 1:
            raise ValueError("num_virtual_stages must be a positive integer")
        self.specs = list(layers)
        if not self.specs:
            raise ValueError("PipelineModule needs at least one layer")
        self.num_stages, self.num_virtual_stages = num_stages, num_virtual_stages
        self.loss_fn = loss_fn
        self.partition_method = partition_method
        self.activation_checkpoint_interval = activation_checkpoint_interval
        self.activation_checkpoint_func = activation_checkpoint_func
        self.checkpointable_layers = checkpointable_layers
        self._tensor_parallel_plan = tensor_parallel_plan
        self.stage_id = self._my_stage() if stage_id is None else stage_id

        names = [s.name if isinstance(s, LayerSpec) else type(s).__name__ for s in self.specs]
        counts = [self._count_params(s) for s in self.specs]
        self.parts = partition_layers(partition_method, names, counts, num_stages * num_virtual_stages)
        # Which stages use each tied key (the engine sums their gradients across those stages).
        self.tie_stages: dict[str, list[int]] = {}
        for idx, spec in enumerate(self.specs):
            if isinstance(spec, TiedLayerSpec):
                stages = self.tie_stages.setdefault(spec.key, [])
                if self.stage_of_layer(idx) not in stages:
                    stages.append(self.stage_of_layer(idx))

        self.layers = nn.ModuleDict()  # built layers, by global index
        self.tied = nn.ModuleDict()  # tied modules, by key
        self.chunks: list[list[tuple[int, object]]] = []  # per local chunk: (layer index, callable)
        for chunk in range(num_virtual_stages):
            part = chunk * num_stages + self.stage_id
            funcs = []
            for idx in range(self.parts[part], self.parts[part + 1]):
                funcs.append((idx, self._build(idx, seed_layers, seed_fn, base_seed)))
            self.chunks.append(funcs)
        # Layers taken from an existing model: checkpoints use that model's parameter names, so they
        # load into it (or into a pipeline of any other depth) unchanged.
        self.source_names: dict[str, str] = {}
        if source_module is not None:
            original = {}  # a tied tensor goes by its first name, as the model's own named_parameters() gives it
            for n, p in source_module.named_parameters(remove_duplicate=False):
                original.setdefault(id(p), n)
            self.source_names = {
                n: original[id(p)] for n, p in self.named_parameters(remove_duplicate=False) if id(p) in original
            }

    # ---- construction -------------------------------------------------------------------------
    def _my_stage(self) -> int:
        """Ranks are laid out pipeline-outermost (see zerotron.topology): stage = rank // (world / stages)."""
        import torch.distributed as dist

        if self.num_stages == 1:
            return 0
        if not dist.is_initialized():
            from ..comm import init_distributed

            init_distributed()
        world, rank = dist.get_world_size(), dist.get_rank()
        if world % self.num_stages:
            raise ValueError(f"num_stages ({self.num_stages}) must divide the number of processes ({world})")
        return rank // (world // self.num_stages)

    @staticmethod
    def _count_params(spec) -> int:
        if isinstance(spec, nn.Module):
            return sum(p.numel() for p in spec.parameters() if p.requires_grad)
        if isinstance(spec, LayerSpec):
            with torch.device("meta"):  # build it without memory, only to count
                module = spec.build()
            return (
                sum(p.numel() for p in module.parameters() if p.requires_grad) if isinstance(module, nn.Module) else 0
            )
        return 0

    def stage_of_layer(self, idx: int) -> int:
        for part in range(len(self.parts) - 1):
            if self.parts[part] <= idx < self.parts[part + 1]:
                return part % self.num_stages
        raise IndexError(f"layer {idx} is outside the model's {len(self.specs)} layers")

    def _build(self, idx, seed_layers, seed_fn, base_seed):
        spec = self.specs[idx]
        if isinstance(spec, TiedLayerSpec):
            if spec.key not in self.tied:
                self._seed(idx, seed_layers, seed_fn, base_seed)
                self.tied[spec.key] = spec.build()
            module = self.tied[spec.key]
            if spec.forward_fn is None:
                return module
            return lambda x, fn=spec.forward_fn, m=module: fn(m, x)
        if isinstance(spec, LayerSpec):
            self._seed(idx, seed_layers, seed_fn, base_seed)
            module = spec.build()
            self.layers[str(idx)] = module
            return module
        if isinstance(spec, nn.Module):
            self.layers[str(idx)] = spec
            return spec
        if callable(spec):  # a plain function, e.g. a reshape between layers
            return spec
        raise TypeError(
            f"layer {idx} is a {type(spec).__name__}; use a LayerSpec, TiedLayerSpec, nn.Module or function"
        )

    @staticmethod
    def _seed(idx, seed_layers, seed_fn, base_seed):
        if seed_layers:
            (seed_fn or torch.manual_seed)(base_seed + idx)

    # ---- running ----------------------------------------------------------------------------
    def forward(self, x, chunk: int = 0):
        """Run this rank's layers of `chunk` on `x`."""
        funcs = self.chunks[chunk]
        interval = self.activation_checkpoint_interval
        if interval and self.training and torch.is_grad_enabled():
            from ..activation_checkpointing import checkpoint

            run = self.activation_checkpoint_func or checkpoint
            for start in range(0, len(funcs), interval):
                group = funcs[start : start + interval]
                x = run(self._run_group, group, x) if self._checkpointable(group) else self._run_group(group, x)
            return x
        return self._run_group(funcs, x)

    @staticmethod
    def _run_group(funcs, x):
        for _, fn in funcs:
            x = fn(x)
        return x

    def _checkpointable(self, group) -> bool:
        if self.checkpointable_layers is None:
            return any(isinstance(fn, nn.Module) and any(True for _ in fn.parameters()) for _, fn in group)
        return all(type(fn).__name__ in self.checkpointable_layers for _, fn in group)

    def repeated_layer_types(self) -> set[str]:
        """The layer classes that repeat in the whole model, whatever this stage holds of it."""
        counts = Counter(s.name for s in self.specs if isinstance(s, LayerSpec) and not isinstance(s, TiedLayerSpec))
        return {name for name, n in counts.items() if n > 1}

    def tied_parameters(self, key: str) -> list[nn.Parameter]:
        """The trainable parameters of the module the stages using `key` share: all of them, not
        only `tied_weight_attr` (which must exist, as in DeepSpeed). A shared module's other
        parameters (GPT-2's position embedding beside its token embedding) would otherwise train on
        one stage and go stale on the others."""
        module = self.tied[key]
        spec = next(s for s in self.specs if isinstance(s, TiedLayerSpec) and s.key == key)
        for attr in spec.tied_weight_attr:
            module.get_parameter(attr)
        return [p for p in module.parameters() if p.requires_grad]

    def tensor_parallel_plan(self, tp: int) -> dict[str, str]:
        plan = self._tensor_parallel_plan
        if plan is None:
            raise ValueError(
                "this PipelineModule has no tensor-parallel plan: pass tensor_parallel_plan= "
                "(a dict of module-name patterns -> styles, or a function of the TP size)"
            )
        return plan(tp) if callable(plan) else plan
