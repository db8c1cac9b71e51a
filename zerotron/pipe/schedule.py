"""Pipeline schedules as plain data: for each stage, the ordered list of forward and backward
actions it runs. Nothing here communicates, so schedules can be checked (and their bubble
predicted) by `simulate` without processes.

A rank holds `chunks` model chunks (virtual stages); chunk c of rank s is virtual stage c·p + s,
so activations go round the ranks `chunks` times. F(c, m) needs F of the previous virtual stage
for micro-batch m; B(c, m) needs B of the next virtual stage (the last one: its own F).

- GPipe: every forward, then every backward. Activations of all micro-batches are alive at once.
- 1F1B: a warm-up of forwards (deeper for earlier stages), then alternate one forward / one
  backward, then the remaining backwards. At most p − s micro-batches are alive on stage s.
- Interleaved 1F1B (chunks > 1): the same with micro-batches taken p at a time per chunk, as in
  Megatron-LM, which shrinks the bubble by the number of chunks.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..config_sections import SCHEDULES
from ..errors import ConfigError



@dataclass(frozen=True)
class Action:
    kind: str    # "F" or "B"
    chunk: int   # the rank's local model chunk
    micro: int   # micro-batch index

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
    if name == "1f1b" and chunks == 1:
        return [_one_f_one_b(s, stages, micro_batches) for s in range(stages)]
    if micro_batches % stages:
        raise ConfigError("gradient_accumulation_steps", micro_batches,
                          f"the interleaved schedule takes micro-batches {stages} at a time: use a multiple of the "
                          f"pipeline stages ({stages}), or the 1f1b schedule")
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


def _interleaved(s: int, p: int, m: int, v: int) -> list[Action]:
    total = m * v

    def forward(k):   # the k-th forward of this rank: chunks advance every p micro-batches
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
    busy: list[float]            # per stage
    max_in_flight: list[int]     # per stage: micro-batch activations alive at once
    messages: dict               # (src, dst, kind) -> [(vstage, micro) in send order]
    received: dict               # (src, dst, kind) -> [(vstage, micro) in receive order]

    @property
    def bubble(self) -> list[float]:
        return [1 - b / self.makespan for b in self.busy]


def simulate(schedule: list[list[Action]], chunks: int = 1, t_forward: float = 1.0,
             t_backward: float = 2.0) -> Simulation:
    """Run the schedule on ideal stages (fixed action times, free transfers, blocking receives in
    program order). Raises RuntimeError if some stage waits on an action that can never happen."""
    p = len(schedule)
    last = p * chunks - 1
    done: dict[tuple[str, int, int], float] = {}   # (kind, vstage, micro) -> finish time
    position, clock = [0] * p, [0.0] * p
    busy, alive, peak = [0.0] * p, [0] * p, [0] * p
    messages: dict = {}
    received: dict = {}

    def dependency(s, a):
        vs = virtual_stage(s, a.chunk, p)
        if a.kind == "F":
            return None if vs == 0 else ("F", vs - 1, a.micro)
        return ("F", vs, a.micro) if vs == last else ("B", vs + 1, a.micro)

    remaining = sum(len(actions) for actions in schedule)
    while remaining:
        progressed = False
        for s in range(p):
            if position[s] == len(schedule[s]):
                continue
            a = schedule[s][position[s]]
            dep = dependency(s, a)
            if dep is not None and dep not in done:
                continue
            vs = virtual_stage(s, a.chunk, p)
            if (a.kind, vs, a.micro) in done:
                raise RuntimeError(f"stage {s} runs {a} twice")
            if a.kind == "B" and ("F", vs, a.micro) not in done:
                raise RuntimeError(f"stage {s} runs {a} before its forward")
            if dep is not None and dep[1] != vs:  # a message from another virtual stage
                src = location(dep[1], p)[0]
                received.setdefault((src, s, a.kind), []).append((dep[1], a.micro))
            start = max(clock[s], done[dep] if dep is not None else 0.0)
            cost = t_forward if a.kind == "F" else t_backward
            clock[s] = start + cost
            busy[s] += cost
            done[(a.kind, vs, a.micro)] = clock[s]
            alive[s] += 1 if a.kind == "F" else -1
            peak[s] = max(peak[s], alive[s])
            nxt = vs + 1 if a.kind == "F" else vs - 1
            if 0 <= nxt <= last and not (a.kind == "F" and vs == last):
                messages.setdefault((s, location(nxt, p)[0], "F" if a.kind == "F" else "B"), []).append((vs, a.micro))
            position[s] += 1
            remaining -= 1
            progressed = True
        if not progressed:
            waiting = {s: schedule[s][position[s]] for s in range(p) if position[s] < len(schedule[s])}
            raise RuntimeError(f"pipeline schedule deadlocks: stages wait forever at {waiting}")
    return Simulation(max(clock), busy, peak, messages, received)


def theoretical_bubble(stages: int, micro_batches: int, chunks: int = 1) -> float:
    """Idle fraction of 1F1B / GPipe with equal stages: (p − 1) / (m + p − 1); interleaving with
    v chunks divides the idle time by v: (p − 1) / (v·m + p − 1)."""
    return (stages - 1) / (chunks * micro_batches + stages - 1)
