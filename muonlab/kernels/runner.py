"""Newton-Schulz for a whole batch of a plan, within a memory budget, optionally as CUDA graphs.

A plan batch may hold dozens of same-shape matrices (24 layers of one weight shape in one
process); orthogonalizing them in one call would hold all their iterates at once (on an H100 a
1B-parameter step peaked at 10 GiB over torch.optim.Muon's, from one 24-matrix batch). The runner
cuts a batch into chunks of at most ``max_batch_matrices`` (the workspace budget over the bytes one
matrix needs), runs each chunk into the same reused workspace, and writes each result straight into
the batch's output. With ``graphs=True`` (CUDA only) each chunk shape's chain is captured once in a
CUDA graph and replayed: a step's Newton-Schulz then costs one launch per chunk instead of three
per iteration, which matters below width ~4096 where eager launches leave the GPU waiting.
"""

from __future__ import annotations

import torch

from .newton_schulz import NSConfig, newton_schulz, resolve_dtype
from .workspace import Workspace, max_batch_matrices

MIN_BUDGET = {"cuda": 256 * 2**20, "cpu": 16 * 2**20}
"""The workspace budget's floor per device type (see ``default_budget``)."""
BUDGET_SHARE = 0.05


def default_budget(param_bytes: int, device_type: str = "cuda") -> int:
    """``max(floor, 5% of the parameters' bytes)``. On a GPU the floor is 256 MiB: enough matrices
    per chunk to keep it busy (one 2048 x 8192 matrix already does). A CPU gains nothing from wide
    batches (on this 2-core machine a 1B/8 step ran as fast with 16 MiB as with 256 MiB, 142 vs
    144 ms), so its floor is 16 MiB and a step adds little beyond the momentum itself."""
    return max(MIN_BUDGET.get(device_type, MIN_BUDGET["cpu"]), int(BUDGET_SHARE * param_bytes))


class _Graphed:
    """One chunk shape's Newton-Schulz captured in a CUDA graph, with its static buffers."""

    def __init__(self, like: torch.Tensor, cfg: NSConfig, dtype: torch.dtype):
        self.input = torch.empty_like(like, memory_format=torch.contiguous_format)
        self.output = torch.empty(like.shape, dtype=dtype, device=like.device)
        self.workspace = Workspace()  # its own: graph buffers must not move
        self.input.copy_(like)
        side = torch.cuda.Stream(like.device)
        side.wait_stream(torch.cuda.current_stream(like.device))
        with torch.cuda.stream(side):  # warm-up off the capture (autotune, backend choice, allocator)
            newton_schulz(self.input, cfg, workspace=self.workspace, out=self.output)
        torch.cuda.current_stream(like.device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            newton_schulz(self.input, cfg, workspace=self.workspace, out=self.output)

    def __call__(self, chunk: torch.Tensor, out: torch.Tensor) -> None:
        self.input.copy_(chunk)
        self.graph.replay()
        out.copy_(self.output)


class NewtonSchulzRunner:
    """Orthogonalizes plan batches chunk by chunk in one reused workspace (see the module doc)."""

    def __init__(self, budget_bytes: int, *, graphs: bool = False):
        self.budget_bytes = int(budget_bytes)
        self.graphs = graphs
        self.workspace = Workspace()
        self._graphed: dict[tuple, _Graphed] = {}

    def chunk_size(self, shape: tuple[int, int], dtype: torch.dtype) -> int:
        return max_batch_matrices(shape, dtype.itemsize, self.budget_bytes)

    def __call__(self, mats: torch.Tensor, cfg: NSConfig) -> torch.Tensor:
        """Orthogonalize ``mats`` (k, A, B); a new tensor in the config's compute dtype."""
        dtype = resolve_dtype(cfg.dtype, mats.device) or mats.dtype
        out = torch.empty(mats.shape, dtype=dtype, device=mats.device)
        step = self.chunk_size(mats.shape[-2:], dtype)
        for start in range(0, mats.shape[0], step):
            chunk, dest = mats[start:start + step], out[start:start + step]
            if self.graphs and mats.is_cuda:
                self._graph_for(chunk, cfg, dtype)(chunk, dest)
            else:
                newton_schulz(chunk, cfg, workspace=self.workspace, out=dest)
        return out

    def _graph_for(self, chunk: torch.Tensor, cfg: NSConfig, dtype: torch.dtype) -> _Graphed:
        key = (tuple(chunk.shape), chunk.dtype, chunk.device, cfg, dtype)
        if key not in self._graphed:
            self._graphed[key] = _Graphed(chunk, cfg, dtype)
        return self._graphed[key]

    @property
    def nbytes(self) -> int:
        """Bytes held between steps: the shared workspace and every graph's static buffers."""
        graphed = sum(g.input.nbytes + g.output.nbytes + g.workspace.nbytes for g in self._graphed.values())
        return self.workspace.nbytes + graphed

    def __getstate__(self):
        return dict(budget_bytes=self.budget_bytes, graphs=self.graphs)  # buffers and graphs are scratch

    def __setstate__(self, state):
        self.__init__(state["budget_bytes"], graphs=state["graphs"])
