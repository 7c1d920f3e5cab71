"""Point-to-point transfer of tensor tuples between stages, with shape headers and abort notices."""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

HEADER_LEN = 64
_OK, _ABORT = 1, 2
_DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16,
    torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
]  # fmt: skip
_DTYPE_INDEX = {dt: i for i, dt in enumerate(_DTYPES)}


class PipelineAbortedError(RuntimeError):
    """Raised on a rank when another stage of its pipeline failed; carries that stage's error.

    Args:
        message: the failing stage's error, as text.
        source_rank: the neighbour the notice came from (it needs no notice back).
    """

    def __init__(self, message: str, source_rank: int) -> None:
        super().__init__(message)
        self.source_rank = source_rank


def encode_header(tensors: Sequence[Tensor], ack: int = 0) -> Tensor:
    """Fixed-size int64 header: status, count, ``ack`` (how many messages the sender has received
    from the destination so far), then (dtype, ndim, *shape) per tensor."""
    fields = [_OK, len(tensors), ack]
    for t in tensors:
        if t.dtype not in _DTYPE_INDEX:
            raise TypeError(f"cannot send a tensor of dtype {t.dtype} between pipeline stages")
        fields += [_DTYPE_INDEX[t.dtype], t.dim(), *t.shape]
    if len(fields) > HEADER_LEN:
        raise ValueError(f"a stage output with {len(tensors)} tensors and these shapes does not fit the {HEADER_LEN}-field header")
    return torch.tensor(fields + [0] * (HEADER_LEN - len(fields)), dtype=torch.int64)


def decode_header(header: Tensor) -> list[tuple[torch.dtype, tuple[int, ...]]]:
    """Inverse of :func:`encode_header` for an OK header: (dtype, shape) of each tensor."""
    fields = header.tolist()
    specs, pos = [], 3
    for _ in range(fields[1]):
        dtype, ndim = _DTYPES[fields[pos]], fields[pos + 1]
        specs.append((dtype, tuple(fields[pos + 2 : pos + 2 + ndim])))
        pos += 2 + ndim
    return specs


def _wire(t: Tensor) -> Tensor:
    """Gloo has no bool: move bools as bytes of the same size."""
    return t.view(torch.uint8) if t.dtype == torch.bool else t


def send_tensors(tensors: Sequence[Tensor], dst: int, device: torch.device, ack: int = 0) -> list[dist.Work]:
    """Post non-blocking sends of a header (carrying ``ack``) and each tensor to global rank ``dst``."""
    tensors = [t.detach().contiguous() for t in tensors]
    header = encode_header(tensors, ack).to(device)
    return [dist.isend(header, dst)] + [dist.isend(_wire(t), dst) for t in tensors]


class Incoming:
    """One tuple on its way from global rank ``src``: the header receive is posted at once, the
    payload receives as soon as the header is in (:meth:`advance`) or when needed (:meth:`wait`)."""

    def __init__(self, src: int, device: torch.device) -> None:
        self.src, self.device = src, device
        self.header = torch.empty(HEADER_LEN, dtype=torch.int64, device=device)
        self.header_work = dist.irecv(self.header, src)
        self.buffers: Optional[list[Tensor]] = None
        self.works: list[dist.Work] = []
        self.aborted = False
        self.ack = 0

    def advance(self) -> None:
        """Post the payload receives if the header has arrived; never blocks."""
        if self.buffers is None and self.header_work.is_completed():
            self._post_payload()

    def _post_payload(self) -> None:
        header = self.header.cpu()
        if int(header[0]) == _ABORT:
            self.aborted = True
            self.buffers = [torch.empty(int(header[1]), dtype=torch.uint8, device=self.device)]
        else:
            self.ack = int(header[2])
            self.buffers = [torch.empty(shape, dtype=dtype, device=self.device) for dtype, shape in decode_header(header)]
        self.works = [dist.irecv(_wire(b), self.src) for b in self.buffers]

    def wait(self) -> tuple[Tensor, ...]:
        """The received tuple; raise if ``src`` sent an abort notice instead."""
        if self.buffers is None:
            self.header_work.wait()
            self._post_payload()
        for work in self.works:
            work.wait()
        assert self.buffers is not None
        if self.aborted:
            message = bytes(self.buffers[0].cpu().tolist()).decode("utf-8", errors="replace")
            raise PipelineAbortedError(message, self.src)
        return tuple(self.buffers)


def send_abort(message: str, dst: int, device: torch.device) -> list[dist.Work]:
    """Tell rank ``dst`` that this pipeline failed, in place of the next tensor tuple it awaits."""
    data = torch.tensor(list(message.encode("utf-8")), dtype=torch.uint8, device=device)
    header = torch.zeros(HEADER_LEN, dtype=torch.int64, device=device)
    header[0], header[1] = _ABORT, data.numel()
    return [dist.isend(header, dst), dist.isend(data, dst)]
