"""The non-finite skip decided on the device: a step that runs whole and writes through a gate.

Muon's default (``nonfinite_decision="host"``) reads this rank's non-finite flag on the host and
shares it in the step's control exchange (muonlab.optim.agreement), so a skipped step runs nothing.
On a GPU that read waits for the backward pass to finish, once per step, and a step that waits
can't be captured in a CUDA graph. Under ``nonfinite_decision="device"`` nothing is read:

1. each rank raises its flag on the device (``nonfinite.flag_on``: the same fused pass);
2. the ranks of the step's group add their flags, each in its own slot of a vector of W numbers
   (one all-reduce on the step's own group, NCCL on GPUs; issued async, waited on by the stream
   before the first write), so every rank holds every rank's flag;
3. the step runs whole (its collectives are the same whether it goes or not), and every write of
   state passes ``go`` (no rank flagged):

   - the grads the momentum reads are ``where(go, g, ...)``: a NaN never reaches the momentum;
   - momentum ("sum" form), AdamW moments and step counts, and an update rule's state are written
     as ``where(go, new, old)``, computed from the same operations as the host decision's ("ema"
     momentum needs no more than its masked grad: lerp(m, m, w) is m);
   - the parameters: the decayed copy through ``where``, the update zeroed by ``masked_fill``.

   A step that goes writes the same bits as under the host decision (tested on the CPU, AdamW
   included: its step count and bias corrections are device tensors here, and the arithmetic keeps
   the host path's order). A skipped step leaves parameters and state exactly as they were (a
   skipped first step makes its state, as zeros, where the host decision makes none).
4. what the step's stats say of it (skipped, which ranks, ``skipped_steps``) is read when asked.

This is how torch's capturable optimizers take GradScaler's ``found_inf``; the cost is the extra
elementwise passes of the masked writes, which the host decision doesn't pay
(benchmarks/bench_optimizer_step.py ``--sets variants``, and bench_peers.py's ``muonlab-device``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm.collectives import rank_or_zero
from . import nonfinite

NONFINITE_DECISIONS = ("host", "device")


class StepGate:
    """One step's decision, on the device: ``go`` is a 0-dim bool tensor, True when no rank of the
    step's group had a non-finite gradient. Made by ``decide``; read on the host only by
    ``flagged_ranks``."""

    def __init__(self, flags: torch.Tensor, ranks: list[int], work=None):
        self._flags, self._ranks, self._work = flags, ranks, work
        self._go: torch.Tensor | None = None

    @classmethod
    def decide(cls, grads, device: torch.device, group=None, plain: bool = False, rank: int | None = None) -> StepGate:
        """This rank's flag over ``grads`` (plain tensors or DTensors; ``plain``: none is a
        DTensor), shared with ``group``'s ranks (None: this process alone, global rank ``rank``,
        None: looked up) in one async all-reduce of one slot per rank."""
        flag = nonfinite.flag_on(grads, device, plain)
        if group is None:
            return cls(flag.view(1), [rank_or_zero() if rank is None else rank])
        ranks = dist.get_process_group_ranks(group)
        flags = torch.zeros(len(ranks), dtype=torch.float32, device=device)
        flags[dist.get_rank(group)] = flag  # a device copy: no host read
        return cls(flags, ranks, dist.all_reduce(flags, group=group, async_op=True))

    @property
    def go(self) -> torch.Tensor:
        """True on the device when the step writes (the all-reduce waited on by the stream)."""
        if self._go is None:
            if self._work is not None:
                self._work.wait()
                self._work = None  # done: nothing live kept (a copy of the optimizer copies its stats)
            self._go = self._flags.sum().eq(0)
        return self._go

    def flagged_ranks(self) -> list[int]:
        """The global ranks whose gradients were non-finite (a host read: on a GPU, one
        synchronisation); none when the step went."""
        _ = self.go  # the all-reduce waited on
        return [rank for rank, flag in zip(self._ranks, self._flags.tolist()) if flag > 0]

    # ---------------------------------------------------------------- the masked writes

    def commit_(self, old: torch.Tensor, new: torch.Tensor) -> None:
        """``old`` becomes ``new`` if the step goes, else stays (bit for bit, whatever ``new`` holds)."""
        torch.where(self.go, new, old, out=old)

    def restore_unless_go_(self, now: torch.Tensor, before: torch.Tensor) -> None:
        """``now`` (written in place by the step) goes back to ``before`` unless the step goes."""
        torch.where(self.go, now, before, out=now)

    def zero_unless_go_(self, updates: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each of ``updates`` in place, zeroed when the step is skipped (a NaN in it too): the
        mask made once for the batch."""
        stop = (self._go if self._go is not None else self.go).logical_not()
        for u in updates:  # a loop, not a comprehension: no Python frame per batch (3.11)
            u.masked_fill_(stop, 0)
        return updates

    def grads_for_momentum(self, grads: list[torch.Tensor], bufs: list[torch.Tensor], form: str) -> list[torch.Tensor]:
        """The grads the momentum reads, each in its buffer's dtype: ``g`` if the step goes; if
        not, the value that leaves the "ema" momentum as it is (lerp(m, m, w) = m exactly) or 0
        for "sum" (whose buffer is committed through ``commit_``): finite, so the skipped step's
        Newton-Schulz input is too. One new tensor per grad, made for the whole batch at once."""
        go = self._go if self._go is not None else self.go  # (the property: a Python call per batch)
        masked = []
        for g, b in zip(grads, bufs):
            masked.append(torch.where(go, g.to(b.dtype), b if form == "ema" else 0.0))
        return masked
