"""Stage-to-stage transfers: activations forward, their gradients backward.

An activation message is a header (dtype, requires-grad flag and shape of each tensor, in a fixed
int64 layout) followed by the tensors, so a receiver never has to know shapes in advance; a
gradient message has exactly the shapes of the activation it answers, which the receiver kept.
Sends are posted asynchronously and waited for only at the end of the schedule; a stage blocks
only on receives. Everything one stage posts between two computations goes out in one
`batch_isend_irecv` call (Megatron's paired send-forward/receive-backward). Tags keep the
messages of different virtual stages apart on gloo; on NCCL (no tags) the schedules' send and
receive orders agree (checked in tests/test_pipeline_schedule.py).
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
    """Posts this rank's sends and receives; counts bytes in `comm` (a zerotron Comm)."""

    def __init__(self, device, comm=None):
        self.device, self.comm = device, comm
        self._queued: list[dist.P2POp] = []
        self._sends: list = []

    def send(self, tensors: tuple, dst: int, tag: int, with_header: bool):
        if with_header:
            self._queued.append(dist.P2POp(dist.isend, encode_header(tensors, self.device), dst, tag=tag))
        for t in tensors:
            self._queued.append(dist.P2POp(dist.isend, t.contiguous(), dst, tag=tag))
            self._count(t)

    def flush(self, recv_ops=()) -> list:
        """Post the queued sends together with `recv_ops`; returns the receive works."""
        ops = self._queued + list(recv_ops)
        self._queued = []
        if not ops:
            return []
        works = self.comm.batch_p2p(ops) if self.comm is not None else dist.batch_isend_irecv(ops)
        n_send = len(ops) - len(recv_ops)
        self._sends += works[:n_send]
        return works[n_send:]

    def recv_activation(self, src: int, tag: int) -> tuple:
        header = torch.empty(HEADER_NUMEL, dtype=torch.int64, device=self.device)
        for w in self.flush([dist.P2POp(dist.irecv, header, src, tag=tag)]):
            w.wait()
        meta = decode_header(header)
        tensors = tuple(torch.empty(shape, dtype=dtype, device=self.device) for dtype, _, shape in meta)
        for w in self.flush([dist.P2POp(dist.irecv, t, src, tag=tag) for t in tensors]):
            w.wait()
        for t, (_, requires_grad, _) in zip(tensors, meta):
            t.requires_grad_(requires_grad)
        return tensors

    def recv_like(self, like: list[torch.Tensor], src: int, tag: int) -> list[torch.Tensor]:
        tensors = [torch.empty_like(t) for t in like]
        for w in self.flush([dist.P2POp(dist.irecv, t, src, tag=tag) for t in tensors]):
            w.wait()
        return tensors

    def finish(self):
        """Post what is queued and wait for every send."""
        self.flush()
        for w in self._sends:
            w.wait()
        self._sends = []

    def _count(self, t: torch.Tensor):
        if self.comm is not None:
            self.comm._count("p2p", t)
