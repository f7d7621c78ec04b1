"""Which calls in a block read a tensor's values on the host: the calls that wait for a GPU.

On a GPU, ``torch.cuda.set_sync_debug_mode("error")`` finds them. ``HostReads`` finds the same
calls on any device, CPU included, so a machine without a GPU can still check that a step reads
nothing back (on a CPU these reads cost nothing, but each one would be a synchronisation on a GPU):

    with HostReads() as reads:
        opt.step()
    assert not reads.calls, reads.report()

It is a ``TorchFunctionMode``: it sees every torch call from Python, and records those of
``HOST_READS`` with the first frame outside torch that made them. ``allow`` names modules whose
reads are meant (e.g. the agreement's digests, made on the host and exchanged on gloo).
"""

from __future__ import annotations

import traceback

import torch
from torch.overrides import TorchFunctionMode

HOST_READS = frozenset({
    torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.__bool__, torch.Tensor.__float__,
    torch.Tensor.__int__, torch.Tensor.__index__, torch.Tensor.nonzero, torch.nonzero, torch.equal,
    torch.allclose, torch.Tensor.equal, torch.Tensor.allclose, torch.masked_select, torch.Tensor.masked_select,
    torch.unique, torch.Tensor.unique, torch.Tensor.cpu,
})
"""Calls whose result on the host depends on a tensor's values (or, for nonzero, masked_select and
unique, whose output size does), and ``cpu()``: a copy to the host, which waits for the device."""


class HostReads(TorchFunctionMode):
    """Records ``(call name, "file:line")`` of each host read made inside the block in ``calls``."""

    def __init__(self, allow: tuple[str, ...] = ()):
        super().__init__()
        self.allow = allow
        self.calls: list[tuple[str, str]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in HOST_READS:
            where = _caller()
            if not any(part in where for part in self.allow):
                self.calls.append((getattr(func, "__name__", str(func)), where))
        return func(*args, **(kwargs or {}))

    def report(self) -> str:
        return "; ".join(f"{name} at {where}" for name, where in self.calls) or "no host reads"


def _caller() -> str:
    """The innermost frame outside torch and this module: the line that asked for the read."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        path = frame.filename.replace("\\", "/")
        if "/torch/" not in path and not path.endswith("trace/host_reads.py"):
            return f"{path}:{frame.lineno}"
    return "?"
