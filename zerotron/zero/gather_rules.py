"""ZeRO-3's rules for when a unit's parameters are gathered, in one place: the engine applies them
to its units as they run (zero/stage3.py), the planner plays them over a model's shape to time a
step (planner/overlap.py, planner/cost.py). Pure Python: sizes in parameter elements.

DeepSpeed's three knobs, as zerotron reads them:
- stage3_prefetch_bucket_size (`window`): while a unit runs, the next ones in execution order are
  gathered as long as fewer than this many elements are gathered ahead of their use (0: none);
- stage3_max_live_parameters (`max_live`): ... and fewer than this many are gathered in all (every
  gathered unit counts: the root, the running one, those ahead and those kept for reuse). The
  last unit started may cross either limit, as in DeepSpeed;
- stage3_max_reuse_distance (`max_reuse`): a unit stays gathered after its forward when fewer than
  this many elements are gathered before its next use (its backward: every later unit's forward
  and backward gather).
"""

from __future__ import annotations

from typing import NamedTuple, Sequence


def prefetch(upcoming: Sequence[tuple[int, bool]], ahead: int, live: int, window: float, max_live: float) -> list[int]:
    """Positions in `upcoming` ((elements, released) of the units that run next, in order) whose
    gather starts now, given `ahead` elements already gathered ahead of their use and `live`
    gathered in all. A unit already gathered (in flight, or kept for reuse) costs nothing."""
    window, room, chosen = window - ahead, max_live - live, []
    for i, (numel, released) in enumerate(upcoming):
        if window <= 0 or room <= 0:
            break
        if released:
            chosen.append(i)
            window -= numel
            room -= numel
    return chosen


def reused_soon(later: Sequence[int], max_reuse: float) -> bool:
    """At the end of a unit's forward: is its next use (its backward) fewer than `max_reuse`
    elements of gathers away? `later`: the elements of the units whose forward and backward run
    between."""
    return 2 * sum(later) < max_reuse


class ForwardStep(NamedTuple):
    started: list[int]  # units (block indices) whose gather starts at this step
    kept: bool  # the block stays gathered after its forward


def forward_plan(
    blocks: Sequence[int], root: int, window: float, max_live: float, max_reuse: float
) -> list[ForwardStep]:
    """The rules played over one training forward (after the first, which records the order): the
    root's start, then each block's, with `blocks` the elements of each block's unit in execution
    order and `root` those of the root unit (gathered from the forward's start to the backward's
    end). Step 0 is the root's; step i + 1 block i's."""
    gathered = [False] * len(blocks)  # (released after the backward: nothing is gathered at the start)
    ahead: set[int] = set()
    plan = []

    def start_from(first: int) -> list[int]:
        live = root + sum(n for n, g in zip(blocks, gathered) if g)
        upcoming = [(blocks[j], not gathered[j]) for j in range(first, len(blocks))]
        started = [first + k for k in prefetch(upcoming, sum(blocks[j] for j in ahead), live, window, max_live)]
        for j in started:
            gathered[j] = True
            ahead.add(j)
        return started

    plan.append(ForwardStep(start_from(0), False))
    for i in range(len(blocks)):
        ahead.discard(i)  # in use now (gathered here if no prefetch did)
        gathered[i] = True
        started = start_from(i + 1)
        kept = reused_soon(blocks[i + 1 :], max_reuse)
        gathered[i] = kept
        plan.append(ForwardStep(started, kept))
    return plan
