"""Async collectives that check their sizes before the call and count bytes at the call.

gloo hangs or fails obscurely on split sizes that don't add up and on non-contiguous inputs, so
every size is checked here first. Bytes are logical: what leaves and enters this rank, excluding
its copy to itself (the same definition as the plan's).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class CommCounter:
    """Bytes sent and received, per path, over one step."""

    sent: dict[str, int] = field(default_factory=dict)
    recv: dict[str, int] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)

    def add(self, path: str, sent: int, recv: int) -> None:
        self.sent[path] = self.sent.get(path, 0) + sent
        self.recv[path] = self.recv.get(path, 0) + recv
        self.calls[path] = self.calls.get(path, 0) + 1


class Pending:
    """A collective in flight: ``wait()`` returns its output tensor."""

    def __init__(self, work, out: torch.Tensor, sent: int, recv: int):
        self.work, self.out, self.sent, self.recv = work, out, sent, recv

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
        return self.out


def pack(tensors, dtype: torch.dtype, *, like: torch.Tensor) -> torch.Tensor:
    """One flat send buffer of ``dtype`` holding ``tensors`` one after another.

    Each tensor is cast and copied into its slice in one pass (a ``.to`` per tensor and then a
    ``cat`` would copy everything twice). A single tensor already in ``dtype`` and contiguous is
    sent as it is. ``like`` gives the device of an empty buffer.
    """
    if len(tensors) == 1 and tensors[0].dtype == dtype and tensors[0].is_contiguous():
        return tensors[0].view(-1)
    out = like.new_empty(sum(t.numel() for t in tensors), dtype=dtype)
    offset = 0
    for t in tensors:
        out[offset:offset + t.numel()].view(t.shape).copy_(t)
        offset += t.numel()
    return out


def all_to_all(send: torch.Tensor, send_splits: list[int], recv_splits: list[int], *, group,
               group_rank: int) -> Pending:
    """all_to_all_single on a flat tensor with uneven splits (elements), started async."""
    size = len(send_splits)
    if len(recv_splits) != size or sum(send_splits) != send.numel():
        raise AssertionError(
            f"all_to_all sizes disagree on group rank {group_rank}: send {send.numel()} elements "
            f"vs splits {send_splits}, recv splits {recv_splits}"
        )
    send = send.contiguous()
    out = send.new_empty(sum(recv_splits))
    item = send.element_size()
    sent = (sum(send_splits) - send_splits[group_rank]) * item
    recv = (sum(recv_splits) - recv_splits[group_rank]) * item
    work = dist.all_to_all_single(out, send, recv_splits, send_splits, group=group, async_op=True)
    return Pending(work, out, sent, recv)


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
        return Pending(work, out, sent, recv)
    pending = all_to_all(send.repeat(size), [sizes[group_rank]] * size, list(sizes), group=group,
                         group_rank=group_rank)
    pending.sent, pending.recv = sent, recv
    return pending
