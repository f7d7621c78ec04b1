"""Reused memory for Newton-Schulz: one arena of bytes per device, carved into the buffers of one
call at a time.

A step orthogonalizes its batches one after another, so the buffers of one batch (the cast and
normalised input, the m x m products, the spare iterate) are dead when the next batch starts.
Carving each call's buffers from the start of one arena makes every batch reuse the same memory:
the transient memory of a step is the largest batch's workspace (bounded by the optimizer's
workspace budget, see ``max_batch_matrices``), not a fresh allocation per batch per step.

The arena grows when a call needs more, and is kept between steps. Work on one device queues on
one stream, so a batch's kernels run after the previous batch's kernels that read the same bytes.
"""

from __future__ import annotations

import sys

import torch

from .backends import BACKENDS, FALLBACK
from .forms import FORMS

ALIGN = 256  # bytes: every buffer starts aligned for any dtype and for vectorised kernels


class Workspace:
    """Buffers for one Newton-Schulz call at a time; later calls reuse (and overwrite) them."""

    def __init__(self):
        self._arenas: dict[torch.device, torch.Tensor] = {}
        self.carved: dict[tuple, list[torch.Tensor]] = {}
        """``take``'s buffers per (device, *specs), kept by the executor (muonlab.kernels.execute)
        while the arena holds them: the same views every step, carved once."""

    def take(self, device: torch.device, specs: list[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
        """One uninitialised buffer per (shape, dtype), disjoint from each other, valid until the
        next ``take`` on the same device."""
        sizes = [dtype.itemsize * int(torch.Size(shape).numel()) for shape, dtype in specs]
        offsets, total = [], 0
        for nbytes in sizes:
            offsets.append(total)
            total += -(-nbytes // ALIGN) * ALIGN
        device = torch.device(device)
        arena = self._arenas.get(device)
        if arena is None or arena.numel() < total:
            self._arenas.pop(device, None)  # free the smaller arena before allocating the larger
            self.carved.clear()  # views of it would keep it alive
            arena = self._arenas[device] = torch.empty(total, dtype=torch.uint8, device=device)
        return [arena[o:o + nbytes].view(dtype).view(shape) for o, nbytes, (shape, dtype) in zip(offsets, sizes, specs)]

    @property
    def nbytes(self) -> int:
        """Bytes held between calls, over all devices."""
        return sum(a.numel() for a in self._arenas.values())

    def release(self) -> None:
        self._arenas.clear()
        self.carved.clear()

    def __getstate__(self):
        return {}  # buffers are scratch, not state: a copy starts empty

    def __setstate__(self, state):
        self.__init__()


def batch_bytes_per_matrix(m: int, n: int, itemsize: int, reuses_input: bool = False, form: str = "plain",
                           backend: str = FALLBACK, input_itemsize: int | None = None,
                           work_itemsize: int | None = None) -> int:
    """Transient bytes one m x n matrix (m <= n) adds to a Newton-Schulz batch: its input, the
    workspace's iterate and two m x m products, and the output, which doubles as the second
    iterate (see ``newton_schulz``): 3 m n + 2 m^2 elements. ``reuses_input``: the result
    overwrites an input already in the compute dtype (``muonlab.kernels.batch_io.Overwrite``), which
    is then the output too: 2 m n + 2 m^2. Another form (``form`` as it runs on this shape) has
    the same iterates and its own number of m x m products (``NSForm.squares``: four for the
    gram form, R, Z, Q and one in flight). A ``backend`` whose kernels take the batch wide
    (``NSBackend.wide``: "triton"): one m n more, as its two iterates are wide buffers of the
    workspace and the output a copy of the last (the kernels want (B, m, n) contiguous; a tall
    output can't be one).

    ``input_itemsize`` (None: ``itemsize``): the input's, which may be wider than the compute
    dtype (Muon's local path hands over fp32 momentum to bf16 Newton-Schulz: counted at bf16, it
    took 1.86x the budget). An input that isn't reused counts at it. An ``Overwrite`` input in
    another dtype is no iterate but its own output, and both iterates are then the workspace's:
    the same bytes on the torch path (one m n to spare on Triton's).

    ``work_itemsize`` (None: ``itemsize``): the iterates' own, where they are not in the compute
    dtype (the gram form's, ``muonlab.kernels.newton_schulz.gram_work_dtype``). Then neither the
    input nor the output can serve as an iterate: the input (also the output where
    ``reuses_input``), the output, and all iterates and products at ``work_itemsize``."""
    squares = FORMS[form].squares
    iterates = 2 + (1 if BACKENDS[backend].wide else 0)  # the output (or reused input) and the spare
    input_bytes = (itemsize if input_itemsize is None else input_itemsize) * m * n
    if work_itemsize is not None and work_itemsize != itemsize:
        output = 0 if reuses_input else itemsize * m * n
        return input_bytes + output + work_itemsize * (iterates * m * n + squares * m * m)
    given = 0 if reuses_input else input_bytes
    return given + itemsize * (iterates * m * n + squares * m * m)


def max_batch_matrices(shape: tuple[int, int], itemsize: int, budget_bytes: int, reuses_input: bool = False,
                       form: str = "plain", backend: str = FALLBACK, input_itemsize: int | None = None,
                       work_itemsize: int | None = None) -> int:
    """How many matrices of ``shape`` one Newton-Schulz call may take within ``budget_bytes``
    (at least one: a single matrix larger than the budget still has to be orthogonalized; any
    number of matrices with a zero dim, which take no bytes)."""
    m, n = sorted(int(d) for d in shape)
    per_matrix = batch_bytes_per_matrix(m, n, itemsize, reuses_input, form, backend, input_itemsize, work_itemsize)
    return max(1, budget_bytes // per_matrix) if per_matrix else sys.maxsize
