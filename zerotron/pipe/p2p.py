"""Stage-to-stage transfers: activations forward, their gradients backward.

A receiver must know what it receives (NCCL's receives have a fixed size) but shapes are never
configured: the first activation message of each batch carries a header (dtype, requires-grad flag
and shape of each tensor, in a fixed int64 layout) in front of the tensors; the batch's other
micro-batches keep those shapes and send the tensors alone. A gradient message has exactly the
shapes of the activation it answers, which the receiver kept.

No header costs a round trip in the common case. The receiver posts the header's receive together
with buffers shaped as the last batch's tensors, so header and tensors arrive as one message. When
the shapes changed (a batch of another sequence length), the sender, which knows what the receiver
expects, fills those buffers with stand-ins and sends the real tensors in a second message, which
the receiver posts once it has read the header: one extra round trip, only then (and at the very
first batch, when the receiver posts the header alone).

Receives are posted ahead (`Inbox`) so that a message arrives while the stage computes; sends are
posted as soon as their tensors exist and waited for at the end of the batch. A received buffer is
read only after its work was waited on (NCCL's rule; zerotron.comm's strict mode enforces it on gloo).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm import host_buffer, to_device

_DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
]
_MAX_TENSORS, _MAX_DIMS = 8, 6
_FIELDS = 3 + _MAX_DIMS  # dtype, requires_grad, ndim, dims
HEADER_NUMEL = 1 + _MAX_TENSORS * _FIELDS


def as_tuple(x) -> tuple:
    if torch.is_tensor(x):
        return (x,)
    if isinstance(x, (tuple, list)) and all(torch.is_tensor(t) for t in x):
        return tuple(x)
    raise TypeError(
        f"a pipeline stage must pass a tensor or a tuple of tensors to the next stage, not {type(x).__name__}"
    )


def encode_header(tensors: tuple, device) -> torch.Tensor:
    if len(tensors) > _MAX_TENSORS:
        raise ValueError(f"a pipeline stage passes {len(tensors)} tensors; at most {_MAX_TENSORS} are supported")
    # written on the host, in page-locked memory on a GPU: a copy from pageable memory would make the
    # host wait for the device to drain before the send
    header = host_buffer(torch.zeros(HEADER_NUMEL, dtype=torch.int64, pin_memory=device.type == "cuda"))
    header[0] = len(tensors)
    for i, t in enumerate(tensors):
        if t.dim() > _MAX_DIMS or t.dtype not in _DTYPES:
            raise ValueError(
                f"cannot send a {t.dtype} tensor of shape {tuple(t.shape)} between pipeline stages "
                f"(at most {_MAX_DIMS} dimensions, dtypes {', '.join(map(str, _DTYPES))})"
            )
        row = 1 + i * _FIELDS
        header[row : row + 3] = torch.tensor([_DTYPES.index(t.dtype), int(t.requires_grad), t.dim()])
        header[row + 3 : row + 3 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    return to_device(header, device)


def decode_header(header: torch.Tensor) -> list[tuple[torch.dtype, bool, tuple[int, ...]]]:
    h = header.tolist()
    out = []
    for i in range(h[0]):
        row = 1 + i * _FIELDS
        ndim = h[row + 2]
        out.append((_DTYPES[h[row]], bool(h[row + 1]), tuple(h[row + 3 : row + 3 + ndim])))
    return out


class P2P:
    """This rank's sends and receives. Every flow — activations from one stage to another, or
    gradients back — has a process group of its own (two ranks): on NCCL each group is one stream on
    which point-to-point operations complete in order and block until matched, so two flows sharing
    one would make the stages wait on each other (interleaved schedules deadlock that way; see
    tests/test_pipeline_schedule.py). Within one flow, messages are received in the order they are
    sent, which the schedules guarantee. `flows[(kind, src, dst)]` is the Comm of a flow; every
    flow counts the bytes it sends in `stats` (a message's tensors, not its header)."""

    def __init__(self, device, flows: dict, stats):
        self.device, self.flows = device, flows
        for comm in flows.values():
            comm.count_into(stats)
        self.rank = dist.get_rank()
        self._sends: list = []
        self._sent_meta: dict = {}  # receiving virtual stage -> [(dtype, shape)] its buffers expect
        self._received_meta: dict = {}  # receiving virtual stage -> what the last header said

    def _post(self, kind: str, src: int, dst: int, ops, header: int = 0):
        """Post `ops` ((isend or irecv, tensor) pairs) on the flow; the first `header` carry a header."""
        if not ops:
            return _NOTHING
        comm = self.flows[(kind, src, dst)]
        return comm.batch_p2p(
            [dist.P2POp(op, t, dst if op is dist.isend else src, group=comm.group) for op, t in ops], header=header
        )

    # ---- sending ----------------------------------------------------------------------------
    def send_activation(self, tensors: tuple, dst: int, vstage: int, first: bool):
        """`first`: the first activation of a batch for `vstage`, which says its dtypes and shapes;
        the others of the batch must keep them."""
        meta = [(t.dtype, tuple(t.shape)) for t in tensors]
        if not first:
            if self._sent_meta.get(vstage) != meta:
                raise ValueError(
                    f"a pipeline stage's output changed within a batch: {_describe(meta)} after "
                    f"{_describe(self._sent_meta.get(vstage, []))}; every micro-batch of a batch must "
                    "have the same shapes (pad the batch), as in DeepSpeed's pipelines"
                )
            self._send("act", dst, tensors)
            return
        expected, self._sent_meta[vstage] = self._sent_meta.get(vstage), meta
        header = encode_header(tensors, self.device)
        if expected == meta:  # the receiver's buffers fit: header and tensors in one message
            self._send("act", dst, tensors, header)
            return
        # The receiver posted the header alone (first batch) or with buffers of the old shapes:
        # fill those, then send the tensors as a message of their own.
        stand_ins = [torch.empty(shape, dtype=dtype, device=self.device) for dtype, shape in expected or []]
        self._send("act", dst, stand_ins, header)
        self._send("act", dst, tensors)

    def send_gradient(self, tensors, dst: int):
        """Tensors whose shapes the receiver knows (the gradients of what it sent)."""
        self._send("grad", dst, tensors)

    def _send(self, kind, dst, tensors, header=None):
        ops = ([] if header is None else [(dist.isend, header)]) + [(dist.isend, t.contiguous()) for t in tensors]
        # a send's buffer may be reused only once it completed: waited for at the end of the batch
        self._sends.append(self._post(kind, self.rank, dst, ops, header=int(header is not None)))

    # ---- receiving --------------------------------------------------------------------------
    def post_activation(self, src: int, vstage: int, first: bool) -> "Incoming":
        """Post the receive of an activation for `vstage`; its wait() returns the tensors."""
        known = self._received_meta.get(vstage)
        if not first:
            buffers = [torch.empty(shape, dtype=dtype, device=self.device) for dtype, _, shape in known]
            return Incoming(
                self._post("act", src, self.rank, [(dist.irecv, t) for t in buffers]),
                buffers,
                [rg for _, rg, _ in known],
            )
        header = torch.empty(HEADER_NUMEL, dtype=torch.int64, device=self.device)
        guess = [torch.empty(shape, dtype=dtype, device=self.device) for dtype, _, shape in known or []]
        work = self._post("act", src, self.rank, [(dist.irecv, header)] + [(dist.irecv, t) for t in guess], header=1)
        return _HeaderedIncoming(work, header, lambda meta: self._after_header(src, vstage, meta, guess))

    def _after_header(self, src: int, vstage: int, meta: list, arrived: list) -> "Incoming":
        """The tensors of an activation whose header said `meta`: those that `arrived` with it when
        their shapes fit, else (new shapes, or the first batch: stand-ins arrived) a receive posted
        now for the tensors the sender sends next."""
        self._received_meta[vstage] = meta
        requires_grad = [rg for _, rg, _ in meta]
        if [(t.dtype, tuple(t.shape)) for t in arrived] == [(d, s) for d, _, s in meta]:
            return Incoming(_NOTHING, arrived, requires_grad)
        buffers = [torch.empty(shape, dtype=dtype, device=self.device) for dtype, _, shape in meta]
        return Incoming(self._post("act", src, self.rank, [(dist.irecv, t) for t in buffers]), buffers, requires_grad)

    def post_gradient(self, like: list[torch.Tensor], src: int) -> "Incoming":
        """Post the receive of the gradients of `like` (what this stage sent)."""
        buffers = [torch.empty_like(t) for t in like]
        return Incoming(self._post("grad", src, self.rank, [(dist.irecv, t) for t in buffers]), buffers)

    def finish(self):
        """Wait for every send of the batch."""
        for w in self._sends:
            w.wait()
        self._sends = []


class Incoming:
    """A posted receive. wait() returns its tensors: before it, they hold nothing (NCCL's rule)."""

    def __init__(self, work, buffers: list, requires_grad: list | None = None):
        self.work, self.buffers, self.requires_grad = work, buffers, requires_grad

    def wait(self) -> tuple:
        self.work.wait()
        for t, flag in zip(self.buffers, self.requires_grad or []):
            t.requires_grad_(flag)
        return tuple(self.buffers)


class _HeaderedIncoming:
    """The first activation of a batch: a header, and buffers shaped as the last batch's tensors.
    `then(meta)` (P2P's) says where the tensors are once the header is read."""

    def __init__(self, work, header, then):
        self.work, self.header, self.then = work, header, then

    def wait(self) -> tuple:
        self.work.wait()
        return self.then(decode_header(self.header)).wait()  # the header is read only after the wait


class Inbox:
    """One batch's receives on one stage, posted ahead. `reads[i]` says what action i reads:
    ("act", src rank, virtual stage, first of the batch) or ("grad", src rank, key of the forward
    it answers), or None. For each incoming flow the next message the schedule reads is posted as
    soon as it is knowable (an activation: at once; a gradient: once `like(key)` gives the tensors
    it answers, i.e. after their forward), so it arrives while the stage computes. One receive per
    flow is outstanding at a time: a flow's messages arrive in order anyway, and buffers are not
    held for micro-batches far ahead."""

    def __init__(self, p2p: P2P, reads: list, like):
        self.p2p, self.reads, self.like = p2p, reads, like
        self.queues: dict = {}
        for i, r in enumerate(reads):
            if r is not None:
                self.queues.setdefault(r[:2], []).append(i)
        self.heads = {flow: 0 for flow in self.queues}  # per flow: position of the next read
        self.posted: dict = {}  # action index -> Incoming
        self.post_ready()

    def post_ready(self):
        for flow, queue in self.queues.items():
            if self.heads[flow] == len(queue) or queue[self.heads[flow]] in self.posted:
                continue
            i = queue[self.heads[flow]]
            kind, src, what, *first = self.reads[i]
            if kind == "act":
                self.posted[i] = self.p2p.post_activation(src, what, first[0])
            elif (tensors := self.like(what)) is not None:
                self.posted[i] = self.p2p.post_gradient(tensors, src)

    def take(self, i: int) -> tuple:
        """The tensors action i reads (waiting for them if they are not there yet)."""
        flow = self.reads[i][:2]
        if self.queues[flow][self.heads[flow]] != i:
            raise RuntimeError(f"action {i} reads out of its flow's order")  # schedules never do
        self.post_ready()
        tensors = self.posted.pop(i).wait()
        self.heads[flow] += 1
        self.post_ready()
        return tensors

    def finish(self):
        if self.posted or any(self.heads[f] != len(q) for f, q in self.queues.items()):
            raise RuntimeError("a pipeline batch ended with receives it did not read")


class _Nothing:
    def wait(self):
        return True


_NOTHING = _Nothing()


def flows(topology, stages_with_chunks: int) -> list[tuple[str, int, int]]:
    """(kind, sending stage, receiving stage) of every flow of a pipeline: activations to the next
    stage and gradients back; with model chunks the last stage also feeds the first."""
    p = topology.pp
    pairs = [(s, s + 1) for s in range(p - 1)] + ([(p - 1, 0)] if stages_with_chunks > 1 and p > 1 else [])
    return [(kind, a, b) if kind == "act" else (kind, b, a) for a, b in pairs for kind in ("act", "grad")]


def _describe(meta) -> str:
    return ", ".join(f"{str(m[0]).removeprefix('torch.')}{list(m[-1])}" for m in meta) or "nothing"
