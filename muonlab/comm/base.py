"""What every communication path does, in four stages the engine can overlap.

    send_out()        start moving inputs so owners hold whole matrices (async)
    wait_out()        -> the whole matrices this rank orthogonalizes, (k, A, B), or None
    send_back(ortho)  start returning each rank its share of the result (async)
    wait_back()       -> this rank's output for every parameter of the batch, in input order

A run is built from one BatchPlan (global, identical on every rank) and this rank's local inputs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .collectives import CommCounter, Pending
from .plan import BatchPlan


@dataclass
class PathContext:
    group: object
    """The torch ProcessGroup of the batch's GroupKey (None for a single process)."""
    group_rank: int
    wire_dtype: torch.dtype
    counter: CommCounter


class PathRun:
    path = "base"

    def __init__(self, batch: BatchPlan, inputs: list[torch.Tensor | None], ctx: PathContext):
        self.batch, self.inputs, self.ctx = batch, inputs, ctx
        self._out: Pending | None = None
        self._back: Pending | None = None
        self.bytes_sent = 0
        self.bytes_recv = 0

    def _count(self, pending: Pending) -> Pending:
        self.ctx.counter.add(self.path, pending.sent, pending.recv)
        self.bytes_sent += pending.sent
        self.bytes_recv += pending.recv
        return pending

    def send_out(self) -> None:
        pass

    def wait_out(self) -> torch.Tensor | None:
        raise NotImplementedError

    def send_back(self, ortho: torch.Tensor | None) -> None:
        raise NotImplementedError

    def wait_back(self) -> list[torch.Tensor]:
        raise NotImplementedError


Orthogonalize = Callable[[torch.Tensor], torch.Tensor]
