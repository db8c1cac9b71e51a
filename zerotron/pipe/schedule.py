"""Pipeline schedules as plain data: for each stage, the ordered list of forward and backward
actions it runs. Nothing here communicates, so schedules can be checked (and their bubble
predicted) by `simulate` without processes.

Actions: F (forward), B (backward) and, in zero-bubble schedules only, W. There B computes only
the gradient of the stage's input (what the previous stage waits for) and W, later, the weight
gradients (zerotron/pipe/backward.py); elsewhere B is the whole backward.

A rank holds `chunks` model chunks (virtual stages); chunk c of rank s is virtual stage c·p + s,
so activations go round the ranks `chunks` times. F(c, m) needs F of the previous virtual stage
for micro-batch m; B(c, m) needs B of the next virtual stage (the last one: its own F).

- GPipe: every forward, then every backward. Activations of all micro-batches are alive at once.
- 1F1B: a warm-up of forwards (deeper for earlier stages), then alternate one forward / one
  backward, then the remaining backwards. At most p − s micro-batches are alive on stage s.
- Interleaved 1F1B (chunks > 1): the same with micro-batches taken p at a time per chunk, as in
  Megatron-LM, which shrinks the bubble by the number of chunks.
- ZB-H1 (zero bubble, Qi et al. 2023, "H1": no more activations alive than 1F1B's first stage):
  1F1B's order with each backward split into B and W. Stage s runs its W's s steps late, so
  the last stages hand gradients back as fast as B alone allows, and the s W's left over fill
  the cool-down, where 1F1B idles. With t_F = t_B = t_W the idle time per stage is (p − 1)·t_F
  instead of 1F1B's 3·(p − 1)·t_F. (torch.distributed.pipelining's ScheduleInterleavedZeroBubble
  gives the same order with one chunk per rank.)
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import SCHEDULES
from ..errors import ConfigError


@dataclass(frozen=True)
class Action:
    kind: str  # "F", "B" or "W"
    chunk: int  # the rank's local model chunk
    micro: int  # micro-batch index

    def __repr__(self):
        return f"{self.kind}{self.chunk}.{self.micro}"


def build_schedule(name: str, stages: int, micro_batches: int, chunks: int = 1) -> list[list[Action]]:
    """Per stage, the actions in execution order."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; choose one of {', '.join(SCHEDULES)}")
    if stages < 1 or micro_batches < 1 or chunks < 1:
        raise ValueError("stages, micro-batches and chunks must be positive")
    if name == "gpipe":
        return [_gpipe(micro_batches, chunks) for _ in range(stages)]
    if name == "zb-h1":
        if chunks > 1:
            raise ConfigError(
                "pipeline.schedule",
                name,
                "zb-h1 runs one model chunk per stage: build the "
                "PipelineModule with num_virtual_stages=1, or use the interleaved schedule",
            )
        return [_zb_h1(s, stages, micro_batches) for s in range(stages)]
    if name == "1f1b" and chunks == 1:
        return [_one_f_one_b(s, stages, micro_batches) for s in range(stages)]
    if name == "interleaved" and chunks == 1:
        raise ConfigError(
            "pipeline.schedule",
            "interleaved",
            "the interleaved schedule needs PipelineModule(num_virtual_stages=2 or more); or use '1f1b'",
        )
    if micro_batches % stages:
        raise ConfigError(
            "gradient_accumulation_steps",
            micro_batches,
            f"the interleaved schedule takes micro-batches {stages} at a time: use a multiple of the "
            f"pipeline stages ({stages}), or the 1f1b schedule",
        )
    return [_interleaved(s, stages, micro_batches, chunks) for s in range(stages)]


def _gpipe(m: int, v: int) -> list[Action]:
    forward = [Action("F", c, i) for c in range(v) for i in range(m)]
    backward = [Action("B", c, i) for c in reversed(range(v)) for i in range(m)]
    return forward + backward


def _one_f_one_b(s: int, p: int, m: int) -> list[Action]:
    warmup = min(p - s - 1, m)
    out = [Action("F", 0, i) for i in range(warmup)]
    for i in range(m - warmup):
        out += [Action("F", 0, warmup + i), Action("B", 0, i)]
    return out + [Action("B", 0, i) for i in range(m - warmup, m)]


def _zb_h1(s: int, p: int, m: int) -> list[Action]:
    warmup = min(p - s - 1, m)
    out = [Action("F", 0, i) for i in range(warmup)]
    weights = 0  # W's run oldest first, from step s on
    for i in range(m):
        if warmup + i < m:
            out.append(Action("F", 0, warmup + i))
        out.append(Action("B", 0, i))
        if i >= s:
            out.append(Action("W", 0, weights))
            weights += 1
    return out + [Action("W", 0, i) for i in range(weights, m)]


def splits_backward(actions: list[Action]) -> bool:
    """True when the schedule runs weight gradients as W actions of their own."""
    return any(a.kind == "W" for a in actions)


def _interleaved(s: int, p: int, m: int, v: int) -> list[Action]:
    total = m * v

    def forward(k):  # the k-th forward of this rank: chunks advance every p micro-batches
        return Action("F", (k % (p * v)) // p, (k // (p * v)) * p + k % p)

    def backward(k):  # backwards walk the chunks in reverse
        return Action("B", v - 1 - (k % (p * v)) // p, (k // (p * v)) * p + k % p)

    warmup = total if m == p else min((p - s - 1) * 2 + (v - 1) * p, total)
    out = [forward(k) for k in range(warmup)]
    for k in range(total - warmup):
        out += [forward(warmup + k), backward(k)]
    return out + [backward(k) for k in range(total - warmup, total)]


def virtual_stage(stage: int, chunk: int, stages: int) -> int:
    return chunk * stages + stage


def location(vstage: int, stages: int) -> tuple[int, int]:
    """(rank's stage, chunk) of a virtual stage."""
    return vstage % stages, vstage // stages


@dataclass
class Simulation:
    makespan: float
    busy: list[float]  # per stage
    max_in_flight: list[int]  # per stage: micro-batch activations alive at once
    messages: dict  # (src, dst, kind) -> [(vstage, micro) in send order]
    received: dict  # (src, dst, kind) -> [(vstage, micro) in receive order]

    @property
    def bubble(self) -> list[float]:
        return [1 - b / self.makespan for b in self.busy]


def simulate(
    schedule: list[list[Action]],
    chunks: int = 1,
    t_forward=1.0,
    t_backward=2.0,
    t_weight=None,
    durations: list[list[float]] | None = None,
) -> Simulation:
    """Run the schedule on ideal stages (fixed action times, free transfers, blocking receives in
    program order). `t_backward` is a whole backward; where the schedule splits it, W takes
    `t_weight` of it (default half) and B the rest. Each time is a number, or one per stage;
    `durations` (per stage, one per action) replaces them, e.g. to replay measured times.
    Raises RuntimeError if some stage waits on an action that can never happen, or runs one out
    of order."""
    p = len(schedule)
    last = p * chunks - 1
    split = any(splits_backward(actions) for actions in schedule)
    t_f, t_b = _per_stage(t_forward, p), _per_stage(t_backward, p)
    t_w = [b / 2 for b in t_b] if t_weight is None else _per_stage(t_weight, p)
    cost = [{"F": f, "B": b - w if split else b, "W": w} for f, b, w in zip(t_f, t_b, t_w)]
    for s, actions in enumerate(schedule):
        for a in actions:
            if a.kind not in cost[s]:
                raise RuntimeError(f"stage {s} runs {a}: actions are F, B or W")
    if durations is None:
        durations = [[cost[s][a.kind] for a in actions] for s, actions in enumerate(schedule)]
    elif [len(d) for d in durations] != [len(actions) for actions in schedule]:
        raise ValueError("durations must give one time per action of each stage")
    frees = "W" if split else "B"  # the action after which a micro-batch's activations are gone
    done: dict[tuple[str, int, int], float] = {}  # (kind, vstage, micro) -> finish time
    position, clock = [0] * p, [0.0] * p
    busy, alive, peak = [0.0] * p, [0] * p, [0] * p
    messages: dict = {}
    received: dict = {}

    def dependency(s, a):
        vs = virtual_stage(s, a.chunk, p)
        if a.kind == "F":
            return None if vs == 0 else ("F", vs - 1, a.micro)
        if a.kind == "W":
            return ("B", vs, a.micro)
        return ("F", vs, a.micro) if vs == last else ("B", vs + 1, a.micro)

    remaining = sum(len(actions) for actions in schedule)
    while remaining:
        progressed = False
        for s in range(p):
            if position[s] == len(schedule[s]):
                continue
            a = schedule[s][position[s]]
            vs = virtual_stage(s, a.chunk, p)
            if (a.kind, vs, a.micro) in done:
                raise RuntimeError(f"stage {s} runs {a} twice")
            if a.kind == "B" and ("F", vs, a.micro) not in done:
                raise RuntimeError(f"stage {s} runs {a} before its forward")
            if a.kind == "W" and ("B", vs, a.micro) not in done:
                raise RuntimeError(f"stage {s} runs {a} before its backward")
            dep = dependency(s, a)
            if dep is not None and dep not in done:
                continue
            if dep is not None and dep[1] != vs:  # a message from another virtual stage
                src = location(dep[1], p)[0]
                received.setdefault((src, s, a.kind), []).append((dep[1], a.micro))
            start = max(clock[s], done[dep] if dep is not None else 0.0)
            clock[s] = start + durations[s][position[s]]
            busy[s] += durations[s][position[s]]
            done[(a.kind, vs, a.micro)] = clock[s]
            alive[s] += 1 if a.kind == "F" else -1 if a.kind == frees else 0
            peak[s] = max(peak[s], alive[s])
            nxt = vs + 1 if a.kind == "F" else vs - 1
            if a.kind != "W" and 0 <= nxt <= last and not (a.kind == "F" and vs == last):
                messages.setdefault((s, location(nxt, p)[0], a.kind), []).append((vs, a.micro))
            position[s] += 1
            remaining -= 1
            progressed = True
        if not progressed:
            waiting = {s: schedule[s][position[s]] for s in range(p) if position[s] < len(schedule[s])}
            raise RuntimeError(f"pipeline schedule deadlocks: stages wait forever at {waiting}")
    missing = [
        a
        for s, actions in enumerate(schedule)
        for a in actions
        if split and a.kind == "B" and ("W", virtual_stage(s, a.chunk, p), a.micro) not in done
    ]
    if missing:
        raise RuntimeError(f"backwards without their weight pass: {missing}")
    return Simulation(max(clock), busy, peak, messages, received)


def _per_stage(value, p: int) -> list[float]:
    values = list(value) if isinstance(value, (list, tuple)) else [value] * p
    if len(values) != p:
        raise ValueError(f"{len(values)} action times for {p} stages")
    return values


def theoretical_bubble(stages: int, micro_batches: int, chunks: int = 1, schedule: str = "1f1b") -> float:
    """Idle fraction of 1F1B / GPipe with equal stages: (p − 1) / (m + p − 1); interleaving with
    v chunks divides the idle time by v: (p − 1) / (v·m + p − 1). ZB-H1 with t_F = t_B = t_W:
    (p − 1) / (3m + p − 1) once m ≥ p; this returns the simulated value, which is that formula
    there and also holds for fewer micro-batches."""
    if schedule == "zb-h1":
        sim = simulate(build_schedule(schedule, stages, micro_batches), t_forward=1.0, t_backward=2.0, t_weight=1.0)
        return max(sim.bubble)
    return (stages - 1) / (chunks * micro_batches + stages - 1)
