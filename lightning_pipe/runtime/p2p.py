"""Point-to-point transfer of tensor tuples between stages, with shape headers (on a CPU side channel when tensors go over NCCL) and abort notices."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

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


@dataclass(frozen=True)
class Channel:
    """Where the parts of a transfer travel.

    Attributes:
        headers: the group headers (and abort notices' headers) go over; ``None``: the default.
            When the tensors go over NCCL this is a gloo group with headers on the CPU, so that
            reading a header (to post or check the payload receives) never waits on the device.
        payload: the group the tensors go over; ``None``: the default.
        header_device: where headers live; ``None``: with the tensors.
    """

    headers: Any = None
    payload: Any = None
    header_device: Optional[torch.device] = None

    def header_on(self, device: torch.device) -> torch.device:
        """The device of a header for tensors on ``device``."""
        return self.header_device if self.header_device is not None else device


DIRECT = Channel()  # headers and tensors together, over the default group


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


Specs = list[tuple[torch.dtype, tuple[int, ...]]]


def decode_header(header: Tensor) -> Specs:
    """Inverse of :func:`encode_header` for an OK header: (dtype, shape) of each tensor."""
    fields = header.tolist()
    specs, pos = [], 3
    for _ in range(fields[1]):
        dtype, ndim = _DTYPES[fields[pos]], fields[pos + 1]
        specs.append((dtype, tuple(fields[pos + 2 : pos + 2 + ndim])))
        pos += 2 + ndim
    return specs


def specs_of(tensors: Sequence[Tensor]) -> Specs:
    """(dtype, shape) of each tensor, as a header describes them."""
    return [(t.dtype, tuple(t.shape)) for t in tensors]


def _wire(t: Tensor) -> Tensor:
    """Gloo has no bool: move bools as bytes of the same size."""
    return t.view(torch.uint8) if t.dtype == torch.bool else t


def _empty(specs: Specs, device: torch.device) -> list[Tensor]:
    return [torch.empty(shape, dtype=dtype, device=device) for dtype, shape in specs]


def _fillers(posted: Optional[Specs], specs: Optional[Specs], device: torch.device) -> list[Tensor]:
    """What fills the payload receives the peer posted ahead for ``posted`` when the message does not match them."""
    return [] if posted is None or posted == specs else _empty(posted, device)


def send_tensors(tensors: Sequence[Tensor], dst: int, device: torch.device, ack: int = 0,
                 posted: Optional[Specs] = None, channel: Channel = DIRECT) -> list[dist.Work]:  # fmt: skip
    """Post non-blocking sends of a header (carrying ``ack``) and each tensor to global rank ``dst``.

    ``posted`` are the specs the receiver posted its payload receives for before the header came
    (those of the previous message on this link, see :class:`Incoming`): if the tensors differ,
    placeholders of those specs are sent first, and the receiver posts new receives.
    """
    tensors = [t.detach().contiguous() for t in tensors]
    header = encode_header(tensors, ack).to(channel.header_on(device))
    fillers = _fillers(posted, specs_of(tensors), device)
    return [dist.isend(header, dst, group=channel.headers)] + _send_payload(fillers + tensors, dst, channel)


def _send_payload(tensors: list[Tensor], dst: int, channel: Channel) -> list[dist.Work]:
    return [dist.isend(_wire(t), dst, group=channel.payload) for t in tensors]


class Incoming:
    """One tuple on its way from global rank ``src``: the header receive is posted at once, and
    so are the payload receives when ``expected`` says what the payload will be (the specs of
    the previous message on this link: a payload whose receive is posted only after its
    header arrived waits milliseconds longer under gloo). Otherwise the payload receives are
    posted as soon as the header is in (:meth:`advance`) or when needed (:meth:`wait`)."""

    def __init__(self, src: int, device: torch.device, expected: Optional[Specs] = None, channel: Channel = DIRECT) -> None:
        self.src, self.device, self.expected, self.channel = src, device, expected, channel
        self.header = torch.empty(HEADER_LEN, dtype=torch.int64, device=channel.header_on(device))
        self.header_work = dist.irecv(self.header, src, group=channel.headers)
        self.early = _empty(expected, device) if expected is not None else []
        self.early_works = self._receive(self.early)
        self.buffers: Optional[list[Tensor]] = None
        self.works: list[dist.Work] = []
        self.aborted = False
        self.ack = 0
        self.specs: Optional[Specs] = None

    def advance(self) -> None:
        """Post the payload receives if the header has arrived; never blocks."""
        if self.buffers is None and self.header_work.is_completed():
            self._post_payload()

    def _post_payload(self) -> None:
        header = self.header.cpu()
        if int(header[0]) == _ABORT:
            self.aborted = True
            specs: Specs = [(torch.uint8, (int(header[1]),))]
        else:
            self.ack = int(header[2])
            specs = self.specs = decode_header(header)
        if self.expected is not None and not self.aborted and specs == self.expected:
            self.buffers, self.works = self.early, self.early_works
            return
        self.buffers = _empty(specs, self.device)
        self.works = self.early_works + self._receive(self.buffers)

    def _receive(self, buffers: list[Tensor]) -> list[dist.Work]:
        return [dist.irecv(_wire(b), self.src, group=self.channel.payload) for b in buffers]

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


def send_abort(message: str, dst: int, device: torch.device, posted: Optional[Specs] = None,
               channel: Channel = DIRECT) -> list[dist.Work]:  # fmt: skip
    """Tell rank ``dst`` that this pipeline failed, in place of the next tensor tuple it awaits
    (``posted``, ``channel``: as for :func:`send_tensors`)."""
    data = torch.tensor(list(message.encode("utf-8")), dtype=torch.uint8, device=device)
    header = torch.zeros(HEADER_LEN, dtype=torch.int64, device=channel.header_on(device))
    header[0], header[1] = _ABORT, data.numel()
    return [dist.isend(header, dst, group=channel.headers)] + _send_payload(_fillers(posted, None, device) + [data], dst, channel)


@dataclass
class Links:
    """What each link of a rank last carried, so that payload receives can be posted before their
    header arrives: the receiver expects the specs it last received from a peer for the kind
    of message (activations or gradients: two ranks may exchange both, interleaved 1F1B at
    d = 2) it reads next, and the sender knows them as the specs it last sent of that kind.
    Keyed by (peer, the receiving action's kind). Both ends must keep (or reset) theirs
    together: one per engine, new when the layout changes."""

    sent: dict[tuple[int, Any], Specs] = field(default_factory=dict)
    received: dict[tuple[int, Any], Specs] = field(default_factory=dict)
