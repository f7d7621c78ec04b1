"""Async collectives that check their sizes before the call and count bytes at the call.

gloo hangs or fails obscurely on split sizes that don't add up and on non-contiguous inputs, so
every size is checked here first. Bytes are logical: what leaves and enters this rank, excluding
its copy to itself (the same definition as the plan's).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .._base import dist_on, rank_or_zero, world_size_or_one  # noqa: F401 (named here by callers)


@dataclass
class CommCounter:
    """Bytes sent and received, per path, over one step."""

    sent: dict[str, int] = field(default_factory=dict)
    recv: dict[str, int] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    memory: object = None
    """The step's ``muonlab.comm.memory.BufferCounter``, made by the engine when it runs the plan
    (None on a step that ran none): the buffers it counted."""

    def add(self, path: str, sent: int, recv: int, calls: int = 1) -> None:
        self.sent[path] = self.sent.get(path, 0) + sent
        self.recv[path] = self.recv.get(path, 0) + recv
        self.calls[path] = self.calls.get(path, 0) + calls


class Pending:
    """A collective in flight: ``wait()`` returns its output tensor.

    A deferred one (``all_to_all(..., defer=True)``) is not issued: it holds its ``request``
    until a ``Coalesced`` sends it with the others of its wave, and its ``wait()`` waits for that."""

    def __init__(self, work, out: torch.Tensor | None, sent: int, recv: int, request: tuple | None = None):
        self.work, self.out, self.sent, self.recv = work, out, sent, recv
        self.request = request
        """(send, send_splits, recv_splits) of a deferred all_to_all; None once issued."""
        self.carrier: Coalesced | None = None
        self.buffers: tuple = ()
        """The send-side tensors it was handed or made (the engine counts their new storages once,
        then drops them: muonlab.comm.memory)."""
        self.recv_nbytes = 0
        """Bytes of its receive buffer (a deferred one's is made when its wave arrives)."""

    @property
    def calls(self) -> int:
        """Collectives this one issued itself: 0 for a deferred one (its wave's counts once)."""
        return 0 if self.request is not None or self.carrier is not None else 1

    def wait(self) -> torch.Tensor:
        if self.carrier is not None:
            self.carrier.wait()
        elif self.request is not None:  # pragma: no cover - the engine issues every wave it defers
            raise AssertionError("a deferred all_to_all was waited on before its wave was issued")
        if self.work is not None:
            self.work.wait()
        return self.out


def pack(tensors, dtype: torch.dtype, *, like: torch.Tensor) -> torch.Tensor:
    """One flat send buffer of ``dtype`` holding ``tensors`` one after another.

    Each tensor is cast and copied into its slice in one pass (a ``.to`` per tensor and then a
    ``cat`` would copy everything twice): contiguous ones by one ``cat`` into the buffer (a call
    per tensor costs host time: 44 against 25 us for twelve 12 x 8 matrices), others one by one.
    A single tensor already in ``dtype`` and contiguous is sent as it is. ``like`` gives the
    device of an empty buffer.
    """
    if len(tensors) == 1 and tensors[0].dtype == dtype and tensors[0].is_contiguous():
        return tensors[0].view(-1)
    out = like.new_empty(sum(t.numel() for t in tensors), dtype=dtype)
    if tensors and all(t.is_contiguous() for t in tensors):
        return torch.cat([t.view(-1) for t in tensors], out=out)
    offset = 0
    for t in tensors:
        out[offset:offset + t.numel()].view(t.shape).copy_(t)
        offset += t.numel()
    return out


def all_to_all(send: torch.Tensor, send_splits: list[int], recv_splits: list[int], *, group,
               group_rank: int, defer: bool = False) -> Pending:
    """all_to_all_single on a flat tensor with uneven splits (elements), started async; with
    ``defer``, checked and counted but not issued (a ``Coalesced`` issues it with its wave)."""
    size = len(send_splits)
    if len(recv_splits) != size or sum(send_splits) != send.numel():
        raise AssertionError(
            f"all_to_all sizes disagree on group rank {group_rank}: send {send.numel()} elements "
            f"vs splits {send_splits}, recv splits {recv_splits}"
        )
    item = send.element_size()
    sent = (sum(send_splits) - send_splits[group_rank]) * item
    recv = (sum(recv_splits) - recv_splits[group_rank]) * item
    if defer:
        pending = Pending(None, None, sent, recv, request=(send, list(send_splits), list(recv_splits)))
    else:
        send = send.contiguous()
        out = send.new_empty(sum(recv_splits))
        work = dist.all_to_all_single(out, send, recv_splits, send_splits, group=group, async_op=True)
        pending = Pending(work, out, sent, recv)
    pending.buffers, pending.recv_nbytes = (send,), sum(recv_splits) * item
    return pending


class Coalesced:
    """The deferred all_to_alls of a wave, sent as one all_to_all_single on their group.

    The send buffer is destination-major: for each destination rank, each member's block for it
    in member order; the received buffer, source-major alike, is cut back into each member's own
    output (laid out as its own all_to_all would have returned it). Every rank builds its wave
    from the same plan, so the members, their order and the split sizes agree across ranks."""

    def __init__(self, members: list[Pending], *, group, group_rank: int):
        requests = [m.request for m in members]
        dtypes = {r[0].dtype for r in requests}
        if len(dtypes) != 1:  # pragma: no cover - one path, one wire dtype
            raise AssertionError(f"a wave's all_to_alls differ in dtype: {sorted(map(str, dtypes))}")
        size = len(requests[0][1])
        blocks = [send.split(splits) for send, splits, _ in requests]
        send = torch.cat([blocks[k][q] for q in range(size) for k in range(len(members))])
        send_splits = [sum(r[1][q] for r in requests) for q in range(size)]
        recv_splits = [sum(r[2][q] for r in requests) for q in range(size)]
        self._members, self._size = members, size
        self._recv_blocks = [r[2][q] for q in range(size) for r in requests]  # source-major, as received
        self._pending = all_to_all(send, send_splits, recv_splits, group=group, group_rank=group_rank)
        for m in members:
            m.request, m.carrier = None, self

    def wait(self) -> None:
        """Wait once, then give each member its output."""
        if self._pending is None:
            return
        received = self._pending.wait().split(self._recv_blocks)
        count = len(self._members)
        for k, m in enumerate(self._members):
            m.out = torch.cat([received[q * count + k] for q in range(self._size)])
        self._pending = None


def all_gather(send: torch.Tensor, sizes: list[int], *, group, group_rank: int) -> Pending:
    """Gather every rank's flat ``send`` (rank q contributes sizes[q] elements) onto every rank.

    Equal sizes use all_gather_into_tensor; unequal ones an all_to_all_single that sends the same
    buffer to everyone (gloo's list all_gather needs equal sizes, and padding would travel).
    """
    size = len(sizes)
    if send.numel() != sizes[group_rank]:
        raise AssertionError(f"all_gather on group rank {group_rank}: {send.numel()} elements, expected {sizes}")
    send = send.contiguous()
    item = send.element_size()
    total = sum(sizes)
    sent = (size - 1) * sizes[group_rank] * item
    recv = (total - sizes[group_rank]) * item
    if len(set(sizes)) == 1:
        out = send.new_empty(total)
        work = dist.all_gather_into_tensor(out, send, group=group, async_op=True)
        pending = Pending(work, out, sent, recv)
        pending.buffers, pending.recv_nbytes = (send,), total * item
        return pending
    pending = all_to_all(send.repeat(size), [sizes[group_rank]] * size, list(sizes), group=group,
                         group_rank=group_rank)
    pending.sent, pending.recv = sent, recv
    pending.buffers = (send, *pending.buffers)  # the send, and its copy for every rank
    return pending
