"""Point-to-point transfer of tensor tuples between stages: one message per tuple, shape headers, abort notices.

Once a link's shapes are known, header and tensors travel packed in one message; the shape headers
go on a CPU side channel when tensors go over NCCL.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from datetime import timedelta
from functools import lru_cache
from typing import Any, Mapping, Optional, Sequence, Union

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

HEADER_LEN = 64
HEADER_BYTES = HEADER_LEN * 8
#: The tag of tensors that travel apart from their header (a message whose receive was posted for
#: other shapes, an abort notice's text). Headers and packed messages go on tag 0, so that
#: receives posted ahead for a peer's next messages take in only those, in send order.
PAYLOAD_TAG = 1
_ACK = 2  # the header field that carries the ack
_OK, _ABORT, _PACKED = (
    1,
    2,
    3,
)  # _OK: the tensors follow, each its own message; _PACKED: they follow the header in its message
_ALIGN = 8  # packed tensors start at multiples of the largest element size
_DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
]
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
        links: where given, the group of its own that carries the tensors from one rank to
            another, by (sender, receiver) global ranks, in place of ``payload``. NCCL runs a
            group's transfers on one stream, in the order each rank posts them, and a large send
            waits until its receive runs; on a group shared by both directions (or by several
            neighbours) a receive posted ahead of a send would hold that send back, and two
            neighbours that each send before they receive would each wait for the other (1F1B's
            steady state). On a group that carries one direction of one link, every rank posts
            its operations in the order the link's messages travel, so none waits on another.
    """

    headers: Any = None
    payload: Any = None
    header_device: Optional[torch.device] = None
    links: Optional[Mapping[tuple[int, int], Any]] = field(default=None, hash=False, compare=False)

    def header_on(self, device: torch.device) -> torch.device:
        """The device of a header for tensors on ``device``."""
        return self.header_device if self.header_device is not None else device

    @property
    def packs(self) -> bool:
        """Whether headers travel with the tensors, so that a tuple of known shapes goes as one
        message (its header, then its tensors, in one buffer: :func:`packed_bytes`)."""
        return self.headers is self.payload and self.header_device is None

    def payload_from(self, src: int, dst: int) -> Any:
        """The group that carries tensors from global rank ``src`` to ``dst``."""
        return self.payload if self.links is None else self.links[src, dst]

    def polls(self) -> bool:
        """Whether a posted header receive reports completion before it is waited on. Gloo's
        do not (``is_completed`` stays false until ``wait``), so polling them is wasted work."""
        return dist.get_backend(self.headers) != "gloo"


DIRECT = Channel()  # headers and tensors together, over the default group


def header_fields(tensors: Sequence[Tensor], ack: int = 0, status: int = _OK) -> list[int]:
    """The :data:`HEADER_LEN` fields of a header: status, count, ``ack`` (how many messages the
    sender has received from the destination so far), then (dtype, ndim, *shape) per tensor."""
    for t in tensors:
        if t.dtype not in _DTYPE_INDEX:
            raise TypeError(f"cannot send a tensor of dtype {t.dtype} between pipeline stages")
    fields = [status, len(tensors), ack, *_spec_fields(specs_of(tensors))]
    if len(fields) > HEADER_LEN:
        raise ValueError(
            f"a stage output with {len(tensors)} tensors and these shapes does not fit the {HEADER_LEN}-field header"
        )
    return fields + [0] * (HEADER_LEN - len(fields))


Specs = tuple[tuple[torch.dtype, tuple[int, ...]], ...]


def _spec_fields(specs: Specs) -> list[int]:
    """The header fields that describe ``specs``: (dtype, ndim, *shape) per tensor."""
    return [field for dtype, shape in specs for field in (_DTYPE_INDEX[dtype], len(shape), *shape)]


def decode_header(fields: list[int]) -> Specs:
    """Inverse of :func:`header_fields` for a header that is not an abort notice: (dtype, shape) of each tensor."""
    specs, pos = [], 3
    for _ in range(fields[1]):
        dtype, ndim = _DTYPES[fields[pos]], fields[pos + 1]
        specs.append((dtype, tuple(fields[pos + 2 : pos + 2 + ndim])))
        pos += 2 + ndim
    return tuple(specs)


def specs_of(tensors: Sequence[Tensor]) -> Specs:
    """(dtype, shape) of each tensor, as a header describes them."""
    return tuple((t.dtype, tuple(t.shape)) for t in tensors)


def _wire(t: Tensor) -> Tensor:
    """Gloo has no bool: move bools as bytes of the same size."""
    return t.view(torch.uint8) if t.dtype == torch.bool else t


def _empty(specs: Specs, device: torch.device) -> list[Tensor]:
    return [torch.empty(shape, dtype=dtype, device=device) for dtype, shape in specs]


def _fillers(posted: Optional[Specs], specs: Optional[Specs], device: torch.device) -> list[Tensor]:
    """What fills the payload receives the peer posted ahead for ``posted`` when the message does
    not match them (a channel that does not pack: each tensor is its own message)."""
    return _empty(posted, device) if _unexpected(posted, specs) else []


def _unexpected(posted: Optional[Specs], specs: Optional[Specs]) -> bool:
    """Whether a message (``specs``; ``None``: an abort notice) differs from what its receiver posted for."""
    return posted is not None and posted != specs


@dataclass(frozen=True)
class Packing:
    """The layout of a packed message for tensors of ``specs``, worked out once per specs
    (:func:`packing`): a transfer on a link of known shapes copies a ready header and reads one
    back with a comparison, rather than building and decoding the header's fields.

    Attributes:
        specs: (dtype, shape) of each tensor.
        spans: where each tensor starts and ends: after the header, each at the next multiple of 8 bytes.
        nbytes: the message's size.
    """

    specs: Specs
    spans: tuple[tuple[int, int], ...]
    nbytes: int
    _header: np.ndarray = field(compare=False, repr=False)  # its header's fields (status packed, ack 0); never written
    _described: list[int] = field(compare=False, repr=False)  # the fields after the ack that describe the specs
    _pads: tuple[Tensor, ...] = field(compare=False, repr=False)  # zero bytes before each tensor, to its span
    _header_bytes: Tensor = field(compare=False, repr=False)  # the header's bytes, sharing _header's memory

    @property
    def fields(self) -> tuple[int, ...]:
        """Its header's fields (status packed, ack 0)."""
        return tuple(self._header.tolist())

    def pack(self, tensors: Sequence[Tensor], ack: int, device: torch.device) -> Tensor:
        """A new message on ``device``: the header (carrying ``ack``), then the tensors' bytes.

        On the CPU, from contiguous tensors, it is one ``torch.cat`` of the header and the
        tensors' bytes: each torch call costs tens of microseconds in a step's cold caches
        (measured: an empty allocation 0.04 ms, a slice and view 0.06 ms), and this path makes
        about five where allocating, writing the header and copying into views made twelve.
        """
        if device.type != "cpu" or not all(t.is_contiguous() for t in tensors):
            fields = self._header.copy()
            fields[_ACK] = ack
            message = _message(fields, self.nbytes, device)
            for view, t in zip(self.views(message), tensors):
                view.copy_(t)  # strided as they are: no contiguous copy first
            return message
        pieces = [self._header_bytes]  # no header tensor per send: the message stays the only allocation
        for pad, t in zip(self._pads, tensors):
            pieces += [pad, t.reshape(-1).view(torch.uint8)]
        message = torch.cat(pieces)
        message.numpy()[8 * _ACK : 8 * _ACK + 8].view(np.int64)[0] = ack
        return message

    def views(self, message: Tensor) -> list[Tensor]:
        """Views of a packed message's tensors (they share its storage, header included)."""
        return [
            message[start:end].view(dtype).view(shape) for (dtype, shape), (start, end) in zip(self.specs, self.spans)
        ]

    def describes(self, header: list[int]) -> bool:
        """Whether ``header`` (its fields) describes this packing's tensors, whatever its status and ack."""
        return header[1] == len(self.specs) and header[3 : 3 + len(self._described)] == self._described


@lru_cache(maxsize=256)
def packing(specs: Specs) -> Packing:
    """The :class:`Packing` of tensors of ``specs`` (cached)."""
    spans, pads, end = [], [], HEADER_BYTES
    for dtype, shape in specs:
        start = -(-end // _ALIGN) * _ALIGN
        pads.append(torch.zeros(start - end, dtype=torch.uint8))
        end = start + math.prod(shape) * dtype.itemsize
        spans.append((start, end))
    described = _spec_fields(specs)
    fields = [_PACKED, len(specs), 0, *described]
    fields += [0] * (HEADER_LEN - len(fields))
    header = np.array(fields, dtype=np.int64)
    return Packing(specs, tuple(spans), end, header, described, tuple(pads), torch.from_numpy(header).view(torch.uint8))


def packed_bytes(specs: Specs) -> int:
    """Bytes of one message that carries a header and tensors of ``specs`` (:class:`Packing`)."""
    return packing(specs).nbytes


def _message(fields: Union[list[int], np.ndarray], nbytes: int, device: torch.device) -> Tensor:
    """A message of ``nbytes`` that begins with a header of ``fields`` (the rest is filled by the
    caller, or not read). The fields are written in place, so that the message is the only
    tensor a send allocates on its device (the memory model counts it alone)."""
    message = torch.empty(nbytes, dtype=torch.uint8, device=device)
    header = message[:HEADER_BYTES].view(torch.int64)
    if message.device.type == "cpu":
        header.numpy()[:] = fields
    else:  # from a host tensor: no device memory beyond the message
        header.copy_(torch.as_tensor(fields, dtype=torch.int64))
    return message


@dataclass
class Transfer:
    """Sends posted for one message: their handles and the tensors they read, kept alive until
    the message is known delivered, and the (dtype, shape) of the tensors it carries."""

    works: list[dist.Work]
    kept: list[Tensor]
    specs: Specs = ()

    def wait(self) -> None:
        """Wait for every send."""
        for work in self.works:
            work.wait()

    def is_completed(self) -> bool:
        """Whether every send reports completion (gloo's only once waited on)."""
        return all(work.is_completed() for work in self.works)


def send_tensors(
    tensors: Sequence[Tensor],
    dst: int,
    device: torch.device,
    ack: int = 0,
    posted: Optional[Specs] = None,
    channel: Channel = DIRECT,
) -> Transfer:
    """Post the non-blocking sends of one tensor tuple, with its header (carrying ``ack``), to global rank ``dst``.

    ``posted`` are the specs the receiver posted for before the header came (those the previous
    message of its name carried, :class:`Links`). On a channel that packs,
    tensors of those specs go with their header as one message (a copy, kept until delivered);
    others go after a header padded to the size that message would have had. On one that does
    not, placeholders of the posted specs go first when the tensors differ, and the receiver
    posts new receives.
    """
    tensors = [t.detach() for t in tensors]
    specs = specs_of(tensors)
    if channel.packs and posted is not None and not _unexpected(posted, specs):
        message = packing(specs).pack(tensors, ack, device)
        return Transfer([dist.isend(message, dst, group=channel.payload)], [message], specs)  # packs: no links
    tensors = [t.contiguous() for t in tensors]
    first = _header_first(header_fields(tensors, ack), specs, posted, device, channel)
    works = [dist.isend(first[0], dst, group=channel.headers)] + _send_payload(first[1:] + tensors, dst, channel)
    return Transfer(works, first + tensors, specs)


def _header_first(
    fields: list[int], specs: Optional[Specs], posted: Optional[Specs], device: torch.device, channel: Channel
) -> list[Tensor]:
    """What goes before a message's tensors (``specs``; ``None``: an abort notice's text) when
    they go one message each: where the receiver posted for a packed message, the header padded
    to that message's size; else the header, then placeholders for payload receives posted for
    other specs (:func:`_fillers`)."""
    if channel.packs and posted is not None:
        return [_message(fields, packed_bytes(posted), device)]
    return [torch.tensor(fields, dtype=torch.int64, device=channel.header_on(device))] + _fillers(posted, specs, device)


def _send_payload(tensors: list[Tensor], dst: int, channel: Channel) -> list[dist.Work]:
    group = channel.payload_from(dist.get_rank(), dst)
    return [dist.isend(_wire(t), dst, group=group, tag=PAYLOAD_TAG) for t in tensors]


class Incoming:
    """One tuple on its way from global rank ``src``, the receive of its first message posted at
    once. Where ``expected`` says what the tuple will be (the specs the previous message of its
    name carried, :class:`Links`), that receive is sized for it: on a channel that packs, one message
    with header and tensors; on one that does not, the header, with the payload receives
    posted beside it (a payload whose receive is posted only after its header arrived waits
    milliseconds longer under gloo). Otherwise, or when the header says the tuple differs, the
    payload receives are posted as soon as the header is in (:meth:`advance`) or when needed
    (:meth:`wait`)."""

    def __init__(
        self, src: int, device: torch.device, expected: Optional[Specs] = None, channel: Channel = DIRECT
    ) -> None:
        self.src, self.device, self.expected, self.channel = src, device, expected, channel
        self.packing = packing(expected) if channel.packs and expected is not None else None
        if self.packing is not None:
            self.message = torch.empty(self.packing.nbytes, dtype=torch.uint8, device=device)
        else:
            self.message = torch.empty(HEADER_LEN, dtype=torch.int64, device=channel.header_on(device))
        self.header_work = dist.irecv(self.message, src, group=channel.headers)
        self.early = _empty(expected, device) if expected is not None and self.packing is None else []
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
        header = (self.message[:HEADER_BYTES].view(torch.int64) if self.packing is not None else self.message).tolist()
        status = header[0]
        if status == _PACKED:
            assert self.packing is not None  # a header alone is never packed
            if not self.packing.describes(header):  # the sender packs only what this receive was posted for
                raise RuntimeError(
                    f"rank {self.src} packed {decode_header(header)} into a message posted for "
                    f"{self.expected}: the links disagree"
                )
            self.ack, self.specs = header[2], self.packing.specs
            self.buffers = self.packing.views(self.message)
            return
        if status == _ABORT:
            self.aborted = True
            specs: Specs = ((torch.uint8, (header[1],)),)
        else:
            self.ack = header[2]
            specs = self.specs = decode_header(header)
        if self.early and not self.aborted and specs == self.expected:
            self.buffers, self.works = self.early, self.early_works
            return
        self.buffers = _empty(specs, self.device)
        self.works = self.early_works + self._receive(self.buffers)

    def _receive(self, buffers: list[Tensor]) -> list[dist.Work]:
        group = self.channel.payload_from(self.src, dist.get_rank())
        return [dist.irecv(_wire(b), self.src, group=group, tag=PAYLOAD_TAG) for b in buffers]

    def wait(self, timeout: Optional[float] = None) -> tuple[Tensor, ...]:
        """The received tuple; raise if ``src`` sent an abort notice instead.

        Args:
            timeout: the most seconds to wait in all; default: the group's timeout for each transfer.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        if self.buffers is None:
            _wait(self.header_work, deadline)
            self._post_payload()
        for work in self.works:
            _wait(work, deadline)
        assert self.buffers is not None
        if self.aborted:
            message = bytes(self.buffers[0].cpu().tolist()).decode("utf-8", errors="replace")
            raise PipelineAbortedError(message, self.src)
        return tuple(self.buffers)


def _wait(work: dist.Work, deadline: Optional[float]) -> None:
    """Wait for ``work`` until ``deadline`` (``time.monotonic()``; ``None``: the group's timeout)."""
    if deadline is None:
        work.wait()
    else:
        work.wait(timedelta(seconds=max(deadline - time.monotonic(), 0.01)))


def timed_out(err: BaseException) -> bool:
    """Whether ``err`` is gloo's timeout of a wait. A wait that times out closes its group's
    links, and may itself raise as one closed so ("Application timeout caused pair closure")."""
    return any(text in str(err) for text in ("Timed out waiting", "Application timeout caused pair closure"))


def send_abort(
    message: str, dst: int, device: torch.device, posted: Optional[Specs] = None, channel: Channel = DIRECT
) -> list[dist.Work]:
    """Tell rank ``dst`` that this pipeline failed, in place of the next tensor tuple it awaits
    (``posted``, ``channel``: as for :func:`send_tensors`)."""
    data = torch.tensor(list(message.encode("utf-8")), dtype=torch.uint8, device=device)
    first = _header_first([_ABORT, data.numel()] + [0] * (HEADER_LEN - 2), None, posted, device, channel)
    return [dist.isend(first[0], dst, group=channel.headers)] + _send_payload(first[1:] + [data], dst, channel)


@dataclass
class Links:
    """What each message of a rank's links carried last time, so that its receive can be posted
    for the whole tuple before its header arrives (one packed message, or the header and payload
    receives beside it where headers take a side channel), and its sender knows what that receive
    was posted for.

    A message is named by the receive that reads it: its kind, its stage and its microbatch's
    place in the step (``microbatch % period``: 2BW numbers microbatches across steps). Both ends
    know that name and the specs the previous message of the name had, whatever the timing:
    a receive posted several messages ahead is sized as exactly as one posted after the message
    before it arrived. Keyed by (peer, name). Both ends must keep (or reset) theirs together:
    one per engine, new when the layout changes.

    Args:
        period: microbatches per step.
    """

    period: int = 1
    sent: dict[tuple[int, Any], Specs] = field(default_factory=dict)
    received: dict[tuple[int, Any], Specs] = field(default_factory=dict)

    def name(self, kind: Any, stage: int, microbatch: int) -> tuple[Any, int, int]:
        """The name of the message that the ``kind`` receive of ``stage`` reads for ``microbatch``."""
        return kind, stage, microbatch % self.period
