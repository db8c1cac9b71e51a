"""What a mixture of experts costs beyond its active parameters' FLOPs: the routed experts' compute on
the busiest rank, and the tokens' all-to-alls under expert parallelism (the one home of their byte count).

Per MoE block, rank and micro-batch of T tokens (this rank's), k routes per token, hidden d, a bytes per
element, E experts over ep ranks (moe/exchange.py):

    forward    dispatch: each route's row to the rank holding its expert; combine: the outputs back
    backward   the same two exchanges the other way round
    one all-to-all: a rank sends the rows routed to other ranks, (ep-1)/ep of T·k under uniform routing
        T·k·d·a·(ep-1)/ep         a pass (forward or backward): twice that (issue 31's 2·T·k·h·bytes·(ep-1)/ep)
    forward also sends the count table first: E int64 counts in equal blocks, 8·E·(ep-1)/ep
    A block whose forward runs again in backward exchanges again (sequence.recomputed_share: every block
    under every_block and selective, whose grouped GEMMs are no matmul the policy keeps).

These are the bytes engine.comm_stats()["all_to_all"] counts when routing is uniform (tested).

Imbalance. Routing is never quite uniform: the busiest rank receives `Layout.expert_imbalance` times the
mean rows (default 1.25, an assumption in the way a capacity factor is), and every rank waits for it,
so its expert FLOPs, its activations and the all-to-alls' bytes are costed at that multiple. With ep 1
every rank runs all its own tokens' routes, whatever the routing: no imbalance.

Time. The engine runs the exchanges on the compute stream and reads the counts on the host first, so
nothing hides them: each costs its bytes over the link plus a latency. The ep ranks are consecutive: while
they share a node NVLink carries everything; beyond it each GPU sends the share bound for other nodes
through its own NIC, beside the share NVLink carries to its neighbours.

Not modelled: dropped tokens (the engine drops none), the grouped GEMMs' lower efficiency on few rows
per expert, expert tensor parallelism, and dense layers beside the sparse ones (every block is costed as
a mixture).
"""

from __future__ import annotations

from .layout import Layout
from .model import ModelShape
from .sequence import recomputed_share


def all_to_all_bytes(shape: ModelShape, tokens: float, ep: int, a: int) -> dict[str, float]:
    """Bytes one rank sends in one MoE block's all-to-alls for `tokens` of its own under uniform routing:
    "rows" (one exchange), "forward" (dispatch, combine and the count table), "backward"."""
    if ep <= 1 or not shape.experts:
        return {"rows": 0.0, "forward": 0.0, "backward": 0.0}
    rows = tokens * shape.top_k * shape.hidden * a * (ep - 1) / ep
    table = shape.experts * 8 * (ep - 1) // ep
    return {"rows": rows, "forward": 2 * rows + table, "backward": 2 * rows}


def expert_flops(shape: ModelShape, checkpoint: str) -> float:
    """FLOPs per token of the routed experts: forward and backward through top_k of them in every block,
    and the forward again where the checkpointing policy recomputes it."""
    if not shape.experts:
        return 0.0
    return shape.expert_flops_per_token() * (1 + recomputed_share(shape, checkpoint) / 3)


def expert_time(
    shape: ModelShape,
    layout: Layout,
    tokens: float,
    a: int,
    per_node: int,
    near: tuple[float, float],
    far: tuple[float, float],
) -> float:
    """Seconds the all-to-alls add to one micro-batch of `tokens` (this rank's). `per_node`: GPUs per
    node; `near`, `far`: (GB/s, latency in us) of NVLink and of a GPU's own NIC (cost.py chooses them)."""
    L = layout
    if L.ep <= 1 or not shape.experts:
        return 0.0
    rows = all_to_all_bytes(shape, tokens, L.ep, a)["rows"] * L.expert_imbalance
    if L.ep <= per_node:
        one = rows / (near[0] * 1e9) + near[1] * 1e-6
    else:  # the share for ranks on other nodes leaves through the NIC while NVLink carries the rest
        remote = (L.ep - per_node) / (L.ep - 1)
        one = max(rows * remote / (far[0] * 1e9), rows * (1 - remote) / (near[0] * 1e9)) + far[1] * 1e-6
    table = (near if L.ep <= per_node else far)[1] * 1e-6  # the counts: latency-bound
    forward = 2 * one + table
    return shape.layers * (forward * (1 + recomputed_share(shape, L.checkpoint)) + 2 * one)
