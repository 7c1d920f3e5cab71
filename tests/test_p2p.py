"""Packed messages in one process: the cached layout agrees with the header built from the tensors themselves."""

from __future__ import annotations

import pytest
import torch

from lightning_pipe.runtime.comm import p2p
from lightning_pipe.runtime.comm.mailbox import Outbox

TUPLES = [
    [torch.randn(3, 4)],
    [torch.randn(2, 3, 5).half(), torch.ones(7, dtype=torch.bool), torch.arange(3)],  # odd sizes: padding before int64
    [torch.tensor(2.5), torch.zeros(0, 4)],  # a 0-dim and an empty tensor
    [torch.randn(4, 3).t(), torch.ones(5, dtype=torch.bool)],  # strided: copied into views, not concatenated
]


@pytest.mark.parametrize("tensors", TUPLES)
def test_a_packed_message_carries_the_header_of_its_tensors_and_their_values(tensors: list[torch.Tensor]) -> None:
    layout = p2p.packing(p2p.specs_of(tensors))
    message = layout.pack(tensors, 11, torch.device("cpu"))
    header = message[: p2p.HEADER_BYTES].view(torch.int64).tolist()
    assert header == p2p.header_fields(tensors, 11, p2p._PACKED)  # built from the tensors, not the cache
    assert layout.describes(header) and p2p.decode_header(header) == p2p.specs_of(tensors)
    # Each tensor at the next multiple of 8 bytes after the previous one, written out.
    end = p2p.HEADER_BYTES
    for t, view in zip(tensors, layout.views(message)):
        start = (end + 7) // 8 * 8
        assert (
            view.untyped_storage().data_ptr() + view.storage_offset() * t.element_size() == message.data_ptr() + start
        )
        assert view.dtype == t.dtype and view.shape == t.shape and torch.equal(view, t)
        end = start + t.numel() * t.element_size()
    assert message.numel() == layout.nbytes == end
    layout.pack(tensors, 12, torch.device("cpu"))  # another message: the first and the cached header keep theirs
    assert message[: p2p.HEADER_BYTES].view(torch.int64).tolist() == header and layout.fields[2] == 0
    assert layout.pack(tensors, 0, torch.device("cpu"))[: p2p.HEADER_BYTES].view(torch.int64).tolist()[:3] == [
        p2p._PACKED,
        len(tensors),
        0,
    ]


def test_a_header_for_other_shapes_is_not_described_by_the_packing() -> None:
    layout = p2p.packing(p2p.specs_of([torch.randn(3, 4)]))
    assert not layout.describes(p2p.header_fields([torch.randn(4, 3)]))
    assert not layout.describes(p2p.header_fields([torch.randn(3, 4).double()]))
    assert not layout.describes(p2p.header_fields([torch.randn(3, 4), torch.randn(1)]))
    assert layout.describes(p2p.header_fields([torch.randn(3, 4)], ack=5))


class _Sent:
    """A posted send's stand-in: whether it reports completion, and whether it was waited on."""

    def __init__(self, done: bool) -> None:
        self.done, self.waited, self.asked = done, False, 0

    def wait(self) -> None:
        self.waited = True

    def is_completed(self) -> bool:
        self.asked += 1
        return self.done


@pytest.mark.parametrize("polls", [False, True])
def test_an_outbox_drops_delivered_messages_and_polls_only_where_sends_report_completion(polls: bool) -> None:
    sent = [_Sent(done=i == 3) for i in range(5)]
    box = Outbox(polls)
    for transfer in sent:
        box.post(transfer)  # type: ignore[arg-type]
    box.release(2)  # the peer has the first two: waited on (at once) and dropped
    assert [s.waited for s in sent] == [True, True, False, False, False]
    kept = [transfer for _, transfer in box.messages]
    assert kept == (sent[2:3] + sent[4:] if polls else sent[2:])  # a completed one goes only where it is asked
    assert sum(s.asked for s in sent) == (3 if polls else 0)
    box.release(5)
    assert not box.messages and all(s.waited for s in sent if s in kept)
