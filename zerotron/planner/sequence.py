"""What splitting each sequence over ranks costs: the bytes Ulysses' all-to-alls and the ring's
point-to-point passes move (the one home of these formulas), and the time they add to a micro-batch.

Per layer, rank and micro-batch of b sequences of s tokens, each rank holding s/(u·c) tokens of each
(u Ulysses ranks, c ring ranks), head size e, H query and K key/value heads, a bytes per element and
t tensor-parallel ranks (which split the heads first):

    Ulysses (long_context/ulysses.py): q, k and v go through an all-to-all from the sequence split to a
    head split before attention, the output back after it; each rank sends (u-1)/u of each of its
    slices [b, s/(u·c), heads/t, e]:
        forward   (u-1)/u · b·s/(u·c) · e · (2H + 2K)/t · a          backward: as much again
    Ring (long_context/ring.py): a rank's key (or value) block is b·s/(u·c) · e · K/t elements (after
    Ulysses' exchange: s/c tokens of K/(u·t) heads, the same count); kv = both blocks:
        forward   kv·(c-1)                        kv  = 2 · b·s/(u·c) · e · K/t · a
        backward  kv·(c-1) + dkv·c                dkv = the same in fp32 (the key/value gradients
                                                  travel with their block and come home after c passes)

Time. Ulysses' four exchanges run in order on the compute stream (nothing hides them); each is its bytes
over the group's bus bandwidth (for an all-to-all NCCL's bus bandwidth is what each GPU sends to the
others per second) plus one latency, as NCCL posts the sends to every peer at once. The u ranks of a
group are neighbours (tp inside them), so the link is NVLink while u·t GPUs share a node.

The ring is played out as the engine issues it (overlap.timeline): each forward step posts the next
block's exchange, computes its queries against the current block and waits for the exchange; each
backward step does the same, then sends the block's gradients on and waits for them, so those are not
hidden. A step's compute is 1/c of the rank's attention core (the load-balanced causal halves give
every step the same share), counted as the rest of the planner counts attention: 4·s·d/t FLOPs per
token forward, twice that backward, at the GEMM rate. What the passes add is the timeline's excess over
that compute (the last forward step, with nothing left to pass, hides nothing) plus the share of the
overlapped transfer the hardware does not hide. The ring's neighbours are u·t ranks apart: NVLink while
a sequence's u·c·t GPUs share a node, beyond it the sender's own NIC (a point-to-point transfer leaves
through its GPU's rail, not a pool of the node's NICs).

A checkpointed block's forward runs again in backward, its exchanges with it: every block under
`every_block`, the checkpointed ones under `every_k`, every block under `selective` (the attention core
is no matmul, so it is recomputed, Ulysses' exchanges and the ring's forward passes with it), none under
`op_sac` (it keeps the attention's output).
"""

from __future__ import annotations

from .hardware import Hardware
from .layout import CHECKPOINT_EVERY, Layout
from .model import ModelShape
from .overlap import added_time, timeline


def ulysses_bytes(shape: ModelShape, micro_batch: int, seq: int, ulysses: int, ring: int = 1, tp: int = 1, a=2):
    """Bytes one rank sends in one layer's forward all-to-alls (q, k, v, output); backward sends as much."""
    if ulysses <= 1:
        return 0.0
    head = shape.hidden // shape.heads
    tokens = micro_batch * seq / (ulysses * ring)
    return (ulysses - 1) / ulysses * tokens * head * (2 * shape.heads + 2 * shape.kv_heads) / tp * a


def ring_bytes(
    shape: ModelShape, micro_batch: int, seq: int, ring: int, ulysses: int = 1, tp: int = 1, a=2
) -> dict[str, float]:
    """One rank's ring traffic in one layer: "kv" (its key and value blocks, one pass), "dkv" (their
    gradients in fp32, one pass), and the totals sent in "forward" and "backward"."""
    if ring <= 1:
        return {"kv": 0.0, "dkv": 0.0, "forward": 0.0, "backward": 0.0}
    elements = 2 * micro_batch * seq / (ulysses * ring) * (shape.hidden // shape.heads) * shape.kv_heads / tp
    kv, dkv = elements * a, elements * 4
    return {"kv": kv, "dkv": dkv, "forward": kv * (ring - 1), "backward": kv * (ring - 1) + dkv * ring}


def recomputed_share(shape: ModelShape, checkpoint: str) -> float:
    """The share of blocks whose forward (attention core and its exchanges included) runs again in backward."""
    if checkpoint in ("every_block", "selective"):
        return 1.0
    if checkpoint == "every_k":
        return -(-shape.layers // CHECKPOINT_EVERY) / shape.layers
    return 0.0


def sequence_time(
    shape: ModelShape,
    layout: Layout,
    seq: int,
    hw: Hardware,
    a: int,
    rate: float,
    ulysses_link: tuple[float, float],
    ring_link: tuple[float, float],
) -> tuple[float, float]:
    """Seconds Ulysses' all-to-alls and the ring's passes add to one micro-batch on one pipeline stage.
    `rate`: the FLOP/s the attention core runs at; the links: (GB/s, latency in us) of the Ulysses
    group and of a ring hop (cost.py chooses them with the other groups' links)."""
    L = layout
    u, c, t = L.ulysses, L.ring, L.tp
    if u * c == 1:
        return 0.0, 0.0
    again = recomputed_share(shape, L.checkpoint)
    layers = shape.layers / L.pp
    ulysses = 0.0
    if u > 1:
        bw, lat = ulysses_link
        one_way = ulysses_bytes(shape, L.micro_batch, seq, u, c, t, a) / (bw * 1e9) + 4 * lat * 1e-6
        ulysses = layers * one_way * (2 + again)  # forward, backward, and the recomputed forward
    ring = 0.0
    if c > 1:
        bw, lat = ring_link
        passes = ring_bytes(shape, L.micro_batch, seq, c, u, t, a)
        kv, dkv = (passes[k] / (bw * 1e9) + lat * 1e-6 for k in ("kv", "dkv"))
        tokens = L.micro_batch * seq / (u * c)
        step = tokens * 4 * seq * shape.hidden / t / rate / c  # one block of the rank's attention core, forward
        pre = [0.0] + [kv] * (c - 1)  # the next block's exchange, posted as a step starts
        forward = added_time(timeline([step] * c, pre=pre, ahead=1), c * step, (c - 1) * kv, hw.overlap)
        finish = timeline([2 * step] * c, pre=pre, post=[dkv] * c, ahead=1, in_flight=0)
        backward = added_time(finish, 2 * c * step, (c - 1) * kv + c * dkv, hw.overlap)
        ring = layers * (forward * (1 + again) + backward)
    return ulysses, ring
