"""Stage-to-stage transfers: activations forward, their gradients backward.

The first activation message of each batch is a header (dtype, requires-grad flag and shape of
each tensor, in a fixed int64 layout) followed by the tensors, so a receiver never has to know
shapes in advance; the batch's other micro-batches keep those shapes and send the tensors alone
(reading a header is a host sync). A gradient message has exactly the shapes of the activation it
answers, which the receiver kept. Sends are posted as soon as their tensors exist and waited for
at the end of the batch; a stage blocks only on receives, and reads a received buffer only after
its work was waited on (NCCL's rule; zerotron.comm's strict mode enforces it on gloo).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.bool,
           torch.uint8, torch.int8, torch.int16]
_MAX_TENSORS, _MAX_DIMS = 8, 6
_FIELDS = 3 + _MAX_DIMS   # dtype, requires_grad, ndim, dims
HEADER_NUMEL = 1 + _MAX_TENSORS * _FIELDS


def as_tuple(x) -> tuple:
    if torch.is_tensor(x):
        return (x,)
    if isinstance(x, (tuple, list)) and all(torch.is_tensor(t) for t in x):
        return tuple(x)
    raise TypeError(f"a pipeline stage must pass a tensor or a tuple of tensors to the next stage, not {type(x).__name__}")


def encode_header(tensors: tuple, device) -> torch.Tensor:
    if len(tensors) > _MAX_TENSORS:
        raise ValueError(f"a pipeline stage passes {len(tensors)} tensors; at most {_MAX_TENSORS} are supported")
    header = torch.zeros(HEADER_NUMEL, dtype=torch.int64)
    header[0] = len(tensors)
    for i, t in enumerate(tensors):
        if t.dim() > _MAX_DIMS or t.dtype not in _DTYPES:
            raise ValueError(f"cannot send a {t.dtype} tensor of shape {tuple(t.shape)} between pipeline stages "
                             f"(at most {_MAX_DIMS} dimensions, dtypes {', '.join(map(str, _DTYPES))})")
        row = 1 + i * _FIELDS
        header[row:row + 3] = torch.tensor([_DTYPES.index(t.dtype), int(t.requires_grad), t.dim()])
        header[row + 3:row + 3 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    return header.to(device)


def decode_header(header: torch.Tensor) -> list[tuple[torch.dtype, bool, tuple[int, ...]]]:
    h = header.tolist()
    out = []
    for i in range(h[0]):
        row = 1 + i * _FIELDS
        ndim = h[row + 2]
        out.append((_DTYPES[h[row]], bool(h[row + 1]), tuple(h[row + 3:row + 3 + ndim])))
    return out


class P2P:
    """This rank's sends and receives. Every flow — activations from one stage to another, or
    gradients back — has a process group of its own (two ranks): on NCCL each group is one stream on
    which point-to-point operations complete in order and block until matched, so two flows sharing
    one would make the stages wait on each other (interleaved schedules deadlock that way; see
    tests/test_pipeline_schedule.py). Within one flow, messages are received in the order they are
    sent, which the schedules guarantee. `flows[(kind, src, dst)]` is the Comm of a flow; `stats`
    the Comm whose counters add up the bytes."""

    def __init__(self, device, flows: dict, stats):
        self.device, self.flows, self.stats = device, flows, stats
        self.rank = dist.get_rank()
        self._sends: list = []
        self._sent_meta: dict = {}      # receiving virtual stage -> what the last header said
        self._received_meta: dict = {}  # receiving virtual stage -> what the last header said

    def _post(self, kind: str, src: int, dst: int, ops):
        comm = self.flows[(kind, src, dst)]
        return comm.batch_p2p([dist.P2POp(op, t, dst if op is dist.isend else src, group=comm.group)
                               for op, t in ops])

    def send_activation(self, tensors: tuple, dst: int, vstage: int, with_header: bool):
        """`with_header`: the first activation of a batch says its dtypes and shapes; the others
        of the batch must keep them (reading a header is a host sync: one per batch, not per
        micro-batch)."""
        meta = [(t.dtype, t.requires_grad, tuple(t.shape)) for t in tensors]
        ops = []
        if with_header:
            self._sent_meta[vstage] = meta
            ops.append((dist.isend, encode_header(tensors, self.device)))
        elif self._sent_meta.get(vstage) != meta:
            raise ValueError(f"a pipeline stage's output changed within a batch: {_describe(meta)} after "
                             f"{_describe(self._sent_meta.get(vstage, []))}; every micro-batch of a batch must "
                             "have the same shapes (pad the batch), as in DeepSpeed's pipelines")
        self._send("act", dst, ops, tensors)

    def send_gradient(self, tensors, dst: int):
        """Tensors whose shapes the receiver knows (the gradients of what it sent)."""
        self._send("grad", dst, [], tensors)

    def _send(self, kind, dst, ops, tensors):
        ops = ops + [(dist.isend, t.contiguous()) for t in tensors]
        for t in tensors:
            self.stats._count("p2p", t)
        # a send's buffer may be reused only once it completed: waited for at the end of the batch
        self._sends.append(self._post(kind, self.rank, dst, ops))

    def recv_activation(self, src: int, vstage: int, with_header: bool) -> tuple:
        if with_header:
            header = torch.empty(HEADER_NUMEL, dtype=torch.int64, device=self.device)
            self._post("act", src, self.rank, [(dist.irecv, header)]).wait()
            self._received_meta[vstage] = decode_header(header)  # only after the wait: before it, nothing is there
        meta = self._received_meta[vstage]
        tensors = tuple(torch.empty(shape, dtype=dtype, device=self.device) for dtype, _, shape in meta)
        self._post("act", src, self.rank, [(dist.irecv, t) for t in tensors]).wait()
        for t, (_, requires_grad, _) in zip(tensors, meta):
            t.requires_grad_(requires_grad)
        return tensors

    def recv_like(self, like: list[torch.Tensor], src: int) -> list[torch.Tensor]:
        tensors = [torch.empty_like(t) for t in like]
        self._post("grad", src, self.rank, [(dist.irecv, t) for t in tensors]).wait()
        return tensors

    def finish(self):
        """Wait for every send of the batch."""
        for w in self._sends:
            w.wait()
        self._sends = []


def flows(topology, stages_with_chunks: int) -> list[tuple[str, int, int]]:
    """(kind, sending stage, receiving stage) of every flow of a pipeline: activations to the next
    stage and gradients back; with model chunks the last stage also feeds the first."""
    p = topology.pp
    pairs = [(s, s + 1) for s in range(p - 1)] + ([(p - 1, 0)] if stages_with_chunks > 1 and p > 1 else [])
    return [(kind, a, b) if kind == "act" else (kind, b, a) for a, b in pairs for kind in ("act", "grad")]


def _describe(meta) -> str:
    return ", ".join(f"{str(d).removeprefix('torch.')}{list(shape)}" for d, _, shape in meta) or "nothing"
