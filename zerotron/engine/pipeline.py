"""PipelineEngine: `train_batch` runs one global batch through the pipeline stages.

Each rank runs its stage's actions from `schedule.build_schedule` in order: F, B and (zero-bubble
schedules) W, which runs the weight half of a backward that B split off (pipe/backward.py). The
receives each action reads are posted ahead (p2p.Inbox), the sends as their tensors exist.
Gradients of every micro-batch accumulate without communication; after the last backward (or W)
they are reduced over the data-parallel group (ZeRO 0/1 all at once; ZeRO-2 reduces each
backward's gradients as it goes, from the hooks that fire where weight gradients are made),
weights tied across stages get their reduced gradients summed between those stages, and the
step clips by the global norm over data, tensor and pipeline ranks.
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist

from ..comm import Comm, shared_group
from ..errors import ConfigError
from ..nested import to_device
from ..pipe.backward import backward_input
from ..pipe.module import PipelineModule
from ..pipe.p2p import P2P, Inbox, as_tuple, flows
from ..pipe.schedule import (
    Action,
    build_schedule,
    location,
    simulate,
    splits_backward,
    theoretical_bubble,
    virtual_stage,
)
from .engine import Engine


class PipelineEngine(Engine):
    shuffles_data = False  # DeepSpeed's PipelineEngine reads training_data in order (its sampler's shuffle=False)

    def __init__(self, module: PipelineModule, config, topology, **kwargs):
        if config.zero_optimization.stage > 2:
            raise ConfigError(
                "zero_optimization.stage",
                config.zero_optimization.stage,
                "pipeline parallelism works with ZeRO stages 0-2; stage 3 regathers every layer "
                "for every micro-batch. Use stage 1 or 2 (or no pipeline)",
            )
        if config.zerotron.sequence_parallel:
            raise ConfigError(
                "zerotron.sequence_parallel",
                True,
                "sequence parallelism is not supported with "
                "pipeline parallelism yet; turn it off or use one pipeline stage",
            )
        if config.pipeline.schedule == "zb-h1" and config.zerotron.checkpoint_policy == "selective":
            raise ConfigError(
                "zerotron.checkpoint_policy",
                "selective",
                "the zb-h1 schedule recomputes a "
                "checkpointed block twice (for B, then for W), which selective checkpointing does not "
                "allow; use every_block or every_k, or the 1f1b schedule",
            )
        chunks = module.num_virtual_stages
        build_schedule(config.pipeline.schedule, topology.pp, config.gradient_accumulation_steps, chunks)  # refused now
        self.stage, self.stages, self.chunks = topology.coords(dist.get_rank()).pp, topology.pp, chunks
        if module.stage_id != self.stage:
            raise RuntimeError(
                f"the PipelineModule was built for stage {module.stage_id} but this rank is stage "
                f"{self.stage}; build it after zerotron.init_distributed() with the same world"
            )
        links = _StageLinks(module, topology)  # the process groups between stages, made first
        self.pp_comm, self.tie_groups = links.pp_comm, links.tie_groups  # (tie_groups: filled by tie_weights)
        super().__init__(module, config, topology, isolate=links.tie_weights, **kwargs)
        self.p2p = P2P(self.device, links.flow_comms, links.pp_comm)  # (each flow's group was connected as it was made)
        self.schedule_name = config.pipeline.schedule
        self._timeline = None
        self._clock = _StageClock(self.device) if config.wall_clock_breakdown else None

    def _comms(self):
        return super()._comms() + [self.pp_comm] + [c for c, _ in self.tie_groups]

    # ---- DeepSpeed's pipeline API --------------------------------------------------------------
    def forward(self, *args, **kwargs):
        raise RuntimeError(
            "a pipeline engine runs whole batches: use engine.train_batch(data_iter) "
            "or engine.eval_batch(data_iter) instead of forward/backward/step"
        )

    backward = step = forward

    def is_first_stage(self) -> bool:
        return self.stage == 0

    def is_last_stage(self) -> bool:
        return self.stage == self.stages - 1

    def train_batch(self, data_iter=None) -> torch.Tensor:
        """One global batch: every micro-batch through the pipeline, reduction, step. Returns the
        mean loss on every rank."""
        self.module.train()
        batches = self._read(data_iter)
        losses = self._run(
            build_schedule(self.schedule_name, self.stages, len(batches), self.chunks)[self.stage], batches, train=True
        )
        # The loss travels from the last stage while the step runs: no stage waits for another to
        # finish its last backward before updating its own weights.
        loss, arrival = self._send_mean_loss(losses)
        self.states.reduce_accumulated()
        for comm, params in self.tie_groups:
            for grad in self.states.reduced_grads(params):
                comm.all_reduce(grad)
        if self.monitor.enabled or (self.global_steps + 1) % self.config.steps_per_print == 0:
            arrival.wait()  # the step logs the loss
        self._record.losses = [loss]
        self.tput_timer.start()
        self.optimizer_step()
        self.micro_steps += len(batches)
        self.tput_timer.stop(global_step=True)
        arrival.wait()
        return self._mean_over_dp(loss)

    @torch.no_grad()
    def eval_batch(self, data_iter=None, num_micro_batches: int | None = None) -> torch.Tensor:
        """Mean loss over one batch (forward only), on every rank."""
        was_training = self.module.training
        self.module.eval()
        try:
            batches = self._read(data_iter, num_micro_batches)
            forwards = [Action("F", c, i) for c in range(self.chunks) for i in range(len(batches))]
            return self._mean_loss(self._run(forwards, batches, train=False))
        finally:
            self.module.train(was_training)

    def pipeline_bubble(self) -> dict:
        """Idle fraction of each stage in the last train_batch, measured over the common window from
        the first stage's start to the last stage's end (collective over the pipeline group); the
        schedule's theoretical bubble (equal stages, t_B = 2·t_F, ZB-H1's B and W as long as F);
        and `replayed`: the schedule replayed on ideal stages (free transfers, nothing between
        actions) whose every action takes the time it took in that batch. Measured minus replayed
        is what the engine adds (transfers, waits, host work); replayed minus theory is the stages'
        own unevenness (a machine where concurrent stages slow each other, uneven layers)."""
        if self._timeline is None:
            raise RuntimeError(
                "pipeline_bubble() reports on the last train_batch: run one first, with "
                '"wall_clock_breakdown": true in the config (timing synchronizes the device)'
            )
        (start, end, durations), micro = self._timeline
        mine = torch.tensor([start, end, *durations], dtype=torch.float64, device=self.device)
        every = [t.tolist() for t in self.pp_comm.all_gather_list(mine)]  # every stage runs as many actions
        window = max(t[1] for t in every) - min(t[0] for t in every)
        schedule = build_schedule(self.schedule_name, self.stages, micro, self.chunks)
        replayed = simulate(schedule, self.chunks, durations=[t[2:] for t in every])
        return {
            "measured": [1 - sum(t[2:]) / window for t in every],
            "theory": theoretical_bubble(self.stages, micro, self.chunks, self.schedule_name),
            "replayed": replayed.bubble,
        }

    # ---- running a schedule --------------------------------------------------------------------
    def _read(self, data_iter, count: int | None = None) -> list:
        it = self._iterator(data_iter)
        batches = []
        for _ in range(count or self.gradient_accumulation_steps()):
            batch = next(it)
            if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
                raise ValueError(
                    "a pipeline batch is (inputs, labels): the first stage reads inputs, the last stage "
                    f"passes labels to loss_fn; got a {type(batch).__name__}"
                )
            (inputs,), _ = self.input_guard.check(
                (batch[0],), {}, self._record, f"step {self.global_steps} on rank {self.global_rank}"
            )
            batches.append((inputs, batch[1]))
        return batches

    def _peer(self, vstage: int) -> int:
        stage, _ = location(vstage, self.stages)
        return self.topology.rank_of(stage, self.coords.dp, self.coords.tp)

    def _run(self, actions: list[Action], batches: list, train: bool) -> list[torch.Tensor]:
        """Run this stage's `actions` over `batches`; the losses (on the last stage). Only the
        computations are timed: waiting for a receive, and sending, count as idle."""
        clock = self._clock if train and self._clock is not None else _NO_CLOCK
        clock.start_batch()
        run = _Batch(batches, train, self.loss_scaler.scale if self.loss_scaler.enabled else 1.0)
        run.inbox = Inbox(self.p2p, self._reads(actions), lambda key: _needing_grad(run.outputs.get(key)))
        if splits_backward(actions):
            run.weights = [p for p in self.module.parameters() if p.requires_grad]
        for i, a in enumerate(actions):
            vs = virtual_stage(self.stage, a.chunk, self.stages)
            if a.kind == "F":
                self._forward(run, i, a, vs, clock)
            elif a.kind == "B":
                self._backward(run, i, a, vs, clock)
            else:
                with clock.span():
                    self.states.begin_backward(False)
                    run.weight_passes.pop((a.chunk, a.micro))()
                    self.states.end_backward()
        run.inbox.finish()
        self.p2p.finish()
        if run.weight_passes:  # the data-parallel reduction must see every weight gradient
            raise RuntimeError(f"the schedule left weight passes unrun: {sorted(run.weight_passes)}")
        if clock is not _NO_CLOCK:
            self._timeline = clock.finish_batch(), len(batches)
        return run.losses

    def _forward(self, run: "_Batch", i: int, a: Action, vs: int, clock):
        key, last = (a.chunk, a.micro), vs == self.stages * self.chunks - 1
        if vs == 0:
            x = feed = to_device(run.batches[a.micro][0], self.device)
        else:
            x = run.inbox.take(i)
            # The received tensors are leaves that collect the gradient to send back; the stage gets
            # copies, which its first layer may modify in place (ReLU(inplace=True)).
            feed = tuple(t.clone() if t.requires_grad else t for t in x)
            x, feed = (x[0], feed[0]) if len(x) == 1 else (x, feed)
        with clock.span():
            y = self.module(feed, chunk=a.chunk)
            y = self._loss(y, run.batches[a.micro][1]) if last else as_tuple(y)
        if run.train:
            run.inputs[key], run.outputs[key] = x, y
        if last:
            run.losses.append(y.detach().float())
        else:
            self.p2p.send_activation(y, self._peer(vs + 1), vs + 1, first=a.micro == 0)
            run.inbox.post_ready()  # the gradient answering this forward can be received now

    def _backward(self, run: "_Batch", i: int, a: Action, vs: int, clock):
        key = (a.chunk, a.micro)
        x, y = run.inputs.pop(key), run.outputs.pop(key)
        if vs == self.stages * self.chunks - 1:
            tensors, grads = [(y / len(run.batches)).float() * run.scale], None
        else:
            tensors, grads = _needing_grad(y), list(run.inbox.take(i))
        received = list(as_tuple(x)) if vs > 0 else []
        with clock.span():
            if run.weights is not None:  # zero bubble: the input's gradient now, the weights' in W
                back, run.weight_passes[key] = backward_input(tensors, grads, received, run.weights)
            else:
                self.states.begin_backward(False)
                torch.autograd.backward(tensors, grads)
                self.states.end_backward()
                back = [t.grad for t in received]
        if vs > 0:
            self.p2p.send_gradient(
                [g if g is not None else torch.zeros_like(t) for t, g in zip(received, back) if t.requires_grad],
                self._peer(vs - 1),
            )

    def _reads(self, actions: list[Action]) -> list:
        """What each action receives (see p2p.Inbox): a forward its activation, unless it is the
        first virtual stage's; a backward its output's gradient, unless it is the last's."""
        last, reads = self.stages * self.chunks - 1, []
        for a in actions:
            vs = virtual_stage(self.stage, a.chunk, self.stages)
            if a.kind == "F" and vs > 0:
                reads.append(("act", self._peer(vs - 1), vs, a.micro == 0))
            elif a.kind == "B" and vs < last:
                reads.append(("grad", self._peer(vs + 1), (a.chunk, a.micro)))
            else:
                reads.append(None)
        return reads

    def _loss(self, output, labels) -> torch.Tensor:
        labels = to_device(labels, self.device)
        loss_fn = self.module.loss_fn
        loss = loss_fn(output, labels) if loss_fn is not None else output
        if not (torch.is_tensor(loss) and loss.numel() == 1):
            raise ValueError(
                "the last pipeline stage must produce a scalar loss: give PipelineModule a loss_fn "
                "(output, labels) -> loss, or make the last layer return the loss"
            )
        return loss

    def _send_mean_loss(self, losses: list[torch.Tensor]):
        """The mean over micro-batches, broadcast from the last stage: (tensor, work to wait for)."""
        value = torch.stack(losses).mean() if losses else torch.zeros((), device=self.device)
        if self.stages == 1:
            return value, _Done()
        return value, self.pp_comm.broadcast(value, src_group_rank=self.stages - 1, async_op=True)

    def _mean_loss(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """The mean over micro-batches on the last stage, sent to every stage, averaged over data parallel."""
        value, arrival = self._send_mean_loss(losses)
        arrival.wait()
        return self._mean_over_dp(value)


def _needing_grad(outputs) -> list | None:
    return None if outputs is None else [t for t in outputs if t.requires_grad]


class _Batch:
    """What a stage keeps while it runs one batch's actions."""

    def __init__(self, batches: list, train: bool, scale: float):
        self.batches, self.train, self.scale = batches, train, scale
        self.inputs, self.outputs, self.weight_passes, self.losses = {}, {}, {}, []
        self.inbox, self.weights = None, None  # weights: set when W actions compute their gradients


class _StageClock:
    """This stage's busy time in a batch and the batch's window, for pipeline_bubble(). On a GPU each
    computation is timed by device events, and the window starts and ends at a device
    synchronization: wall_clock_breakdown turns it on, since the synchronizations cost time."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def _now(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def start_batch(self):
        if self.cuda:
            torch.cuda.synchronize()
        self.start, self.spans = time.time(), []

    @contextlib.contextmanager
    def span(self):
        began = self._now()
        yield
        self.spans.append((began, self._now()))

    def finish_batch(self) -> tuple[float, float, list[float]]:
        """(start, end, seconds each action took, in schedule order)."""
        if self.cuda:
            torch.cuda.synchronize()
            return self.start, time.time(), [a.elapsed_time(b) / 1e3 for a, b in self.spans]
        return self.start, time.time(), [b - a for a, b in self.spans]


class _NoClock:
    def start_batch(self):
        pass

    def span(self):
        return contextlib.nullcontext()


_NO_CLOCK = _NoClock()


class _Done:
    def wait(self):
        pass


class _StageLinks:
    """What joins this rank's stage to the others: the pipeline group, one group per
    stage-to-stage flow (every rank creates every group, in one order), and a group per weight
    tied across stages. Built before the engine; the tied weights are read from the split model."""

    def __init__(self, module: PipelineModule, topology):
        self.pp_comm = Comm(topology.group("pp"), "pp")
        self.topology, self.module, me = topology, module, dist.get_rank()
        t = topology
        self.flow_comms = {}
        for kind, src, dst in flows(t, module.num_virtual_stages):
            for dp in range(t.dp):
                for tp in range(t.tp):
                    a, b = t.rank_of(src, dp, tp), t.rank_of(dst, dp, tp)
                    group = shared_group(sorted({a, b}), purpose=f"p2p {kind} {src}->{dst}")
                    if me in (a, b):
                        self.flow_comms[(kind, a, b)] = Comm(group, "pp")
        self._tie_comms: list[tuple[str, int, Comm]] = []  # (tie key, stages sharing it, group)
        for key in sorted(module.tie_stages):
            stages = sorted(module.tie_stages[key])
            if len(stages) < 2:
                continue
            for dp in range(t.dp):
                for tp in range(t.tp):
                    ranks = [t.rank_of(s, dp, tp) for s in stages]
                    group = shared_group(ranks)
                    if me in ranks:
                        self._tie_comms.append((key, len(stages), Comm(group, "tied")))
        self.tie_groups: list[tuple[Comm, list]] = []

    def tie_weights(self, module: PipelineModule) -> list[list]:
        """The placed, split model's tied weights: every stage sharing one starts from one copy,
        and each is counted once in the gradient norm. They get gradient buckets of their own, so
        their reduced gradients line up between the stages that share them."""
        for key, copies, comm in self._tie_comms:
            params = module.tied_parameters(key)
            for p in params:
                comm.broadcast(p.data, src_group_rank=0)
                p.tied_copies = copies
            self.tie_groups.append((comm, params))
        return [params for _, params in self.tie_groups]
