"""Newton-Schulz for a whole batch of a plan, within a memory budget, optionally as CUDA graphs.

A plan batch may hold dozens of same-shape matrices (24 layers of one weight shape in one
process); orthogonalizing them in one call would hold all their iterates at once (on an H100 a
1B-parameter step peaked at 10 GiB over torch.optim.Muon's, from one 24-matrix batch). The runner
cuts a batch into chunks of at most ``max_batch_matrices`` (the workspace budget over the bytes one
matrix needs), runs each chunk into the same reused workspace, and writes each result straight into
the batch's output. With ``graphs=True`` (CUDA only) each chunk shape's chain is captured once in a
CUDA graph and replayed: a step's Newton-Schulz then costs one launch per chunk instead of three
per iteration, which matters below width ~4096 where eager launches leave the GPU waiting.

Every chunk's output passes ``health`` (muonlab.kernels.health): while a step records, each
matrix's Frobenius norm against sqrt(min(m, n)) is counted on the device, with no host read.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from .health import UpdateHealth
from .batch_io import Overwrite, batch_pieces, load_pieces, store_pieces
from .config import NSConfig, form_for
from .newton_schulz import newton_schulz, pick_backend, possible_backends, resolve_dtype, work_dtype
from .workspace import Workspace, max_batch_matrices

MIN_BUDGET = {"cuda": 256 * 2**20, "cpu": 8 * 2**20}
"""The workspace budget's floor per device type (see ``default_budget``)."""
BUDGET_SHARE = 0.05


def default_budget(param_bytes: int, device_type: str = "cuda") -> int:
    """``max(floor, 5% of the parameters' bytes)``. On a GPU the floor is 256 MiB: enough matrices
    per chunk to keep it busy (one 2048 x 8192 matrix already does). On a 2-core Intel Xeon with
    AMX bf16 units a 1B/8 step (benchmarks/bench_gpu_step.py's budget sweep, the gram form where it
    saves 20%) ran at 2.39x torch.optim.Muon's speed with 8 MiB against 2.60x with 16 MiB, and
    added 1.23x its memory against 1.32x (RSS, one-time library start-up then included); with
    4 MiB (fewer matrices per batched call) it ran at 1.98x and added 1.08x. A width-256 GPT's
    step with fp32 parameters ran at 2.14x with 8 MiB (benchmarks/results/optimizer_step.md) and
    1.84x with the floor at 6 MiB. On a 2-core AMD EPYC with AVX512-BF16, where torch.optim.Muon's
    one-matrix products already run at about 60% of the bf16 matmul rate, the same sweep
    (benchmarks/results/gpu_step_cpu_proxy.md, start-up excluded) gave 1.86x at 8 MiB, 1.91x at 16
    and 1.70x at 4 (an earlier run on a busier machine: 1.65x, 1.68x, 1.52x), adding 1.28x / 1.30x /
    1.10x the RSS and 1.17x / 1.36x / 1.08x the tensor bytes. So the CPU floor is 8 MiB."""
    return max(MIN_BUDGET.get(device_type, MIN_BUDGET["cpu"]), int(BUDGET_SHARE * param_bytes))


def matrices_within(budget_bytes: int, shape, dtype: torch.dtype, cfg: NSConfig | None = None,
                    reuses_input: bool = False, device: torch.device | str | None = None,
                    input_dtype: torch.dtype | None = None) -> int:
    """Matrices of ``shape`` one Newton-Schulz call under ``cfg`` (its form on this shape; None:
    the plain form) may take within ``budget_bytes`` in ``dtype`` (``reuses_input``: results
    overwrite inputs of the compute dtype; ``input_dtype``, None for ``dtype``: the inputs', as
    they are handed over; see ``batch_bytes_per_matrix``). The one rule behind the runner's
    chunks, Muon's plan and ``muonlab.simulate``'s.

    On a ``device`` where ``cfg``'s backend may run Triton (``"triton"``, or ``"auto"`` where
    Triton can run: its pick is timed per batch size, and a plan or a runner cuts batches
    smaller than this count, evenly), the Triton path's bytes count: fewer matrices, for which
    either backend stays within the budget whatever it picks; the count then depends on no
    timing, so every rank plans the same batches. Without a device (``muonlab.simulate``),
    ``"triton"`` counts the Triton path's bytes, as every run it can make does (where Triton
    can't run, a run is refused), and ``"auto"`` the torch path's: its choice is made on the
    device itself."""
    form = "plain" if cfg is None else form_for(cfg, shape)
    if cfg is None or cfg.backend == "torch":
        on_triton = False
    elif device is None:
        on_triton = cfg.backend == "triton"
    else:
        on_triton = "triton" in possible_backends(cfg.backend, device, dtype)
    input_itemsize = None if input_dtype is None else input_dtype.itemsize
    # the iterates' own bytes where the form iterates in another dtype (the gram form's fp16 or fp32)
    work_itemsize = None if cfg is None else work_dtype(cfg, form, dtype, device).itemsize
    return max_batch_matrices(shape, dtype.itemsize, budget_bytes, reuses_input, form,
                              backend="triton" if on_triton else "torch", input_itemsize=input_itemsize,
                              work_itemsize=work_itemsize)


def _even_sizes(total: int, size: int) -> tuple[int, int]:
    """``_chunks``' split of ``total`` matrices under ``size``: (matrices per chunk, how many of
    the first chunks take one more)."""
    return divmod(total, max(1, -(-total // size)))


def _chunks(pieces: list[torch.Tensor], size: int):
    """(offset, pieces) per run of at most ``size`` matrices over the concatenation of ``pieces``
    (each (k_i, A, B)), as even as can be (64 under 30 as 22+21+21: fewer distinct shapes for the
    matmul library); a piece crossing a boundary is cut into views."""
    size, extra = _even_sizes(sum(p.shape[0] for p in pieces), size)
    chunk, count, start = [], 0, 0
    for p in pieces:
        taken = 0
        while taken < p.shape[0]:
            want = size + (1 if extra > 0 else 0)
            n = min(want - count, p.shape[0] - taken)
            chunk.append(p[taken:taken + n])
            taken, count = taken + n, count + n
            if count == want:
                yield start, chunk
                chunk, start, count, extra = [], start + count, 0, extra - 1
    if count:
        yield start, chunk


def _fixed(cfg: NSConfig, backends) -> dict[str, NSConfig]:
    """{backend: ``cfg`` running on it} for each of ``backends``."""
    return {b: cfg if b == cfg.backend else replace(cfg, backend=b) for b in set(backends)}


class _Graphed:
    """One chunk shape's Newton-Schulz captured in a CUDA graph, with its static buffers."""

    def __init__(self, chunk: list[torch.Tensor], cfg: NSConfig, dtype: torch.dtype):
        first = chunk[0]
        shape = (sum(p.shape[0] for p in chunk), *first.shape[-2:])
        self.input = torch.empty(shape, dtype=first.dtype, device=first.device)
        self.output = torch.empty(shape, dtype=dtype, device=first.device)
        self.workspace = Workspace()  # its own: graph buffers must not move
        load_pieces(self.input, chunk)
        side = torch.cuda.Stream(first.device)
        side.wait_stream(torch.cuda.current_stream(first.device))
        with torch.cuda.stream(side):  # warm-up off the capture (autotune, backend choice, allocator)
            newton_schulz(self.input, cfg, workspace=self.workspace, out=self.output)
        torch.cuda.current_stream(first.device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            newton_schulz(self.input, cfg, workspace=self.workspace, out=self.output)

    def __call__(self, chunk: list[torch.Tensor], out: torch.Tensor | list[torch.Tensor]) -> None:
        load_pieces(self.input, chunk)
        self.graph.replay()
        store_pieces(self.output, [out] if isinstance(out, torch.Tensor) else out)


class NewtonSchulzRunner:
    """Orthogonalizes plan batches chunk by chunk in one reused workspace (see the module doc)."""

    def __init__(self, budget_bytes: int, *, graphs: bool = False):
        self.budget_bytes = int(budget_bytes)
        self.graphs = graphs
        self.workspace = Workspace()
        self._graphed: dict[tuple, _Graphed] = {}
        self.health = UpdateHealth()
        """Counts the orthogonalized matrices that are not sane, per step (``UpdateHealth``)."""
        self._sized: dict[tuple, tuple] = {}
        """``_sized_chunks``' decisions per batch key: (matrices per chunk, {chunk size: backend},
        {backend: config})."""
        self.ran: dict[tuple[int, int], dict[str, str]] = {}
        """{matrix shape: {"dtype", "form", "backend"}} as last run, for reports of what "auto" chose."""

    def chunk_size(self, shape: tuple[int, int], dtype: torch.dtype, reuses_input: bool = False,
                   cfg: NSConfig | None = None, device: torch.device | str | None = None,
                   input_dtype: torch.dtype | None = None) -> int:
        """Matrices per call within the budget (``matrices_within``)."""
        return matrices_within(self.budget_bytes, shape, dtype, cfg, reuses_input, device, input_dtype)

    def __call__(self, mats: torch.Tensor | list[torch.Tensor], cfg: NSConfig):
        """Orthogonalize ``mats``: one (..., A, B) stack, or a list of (..., A, B) pieces taken as
        their concatenation (read straight into the workspace, never stacked first). Returns a new
        tensor in the config's compute dtype, of the stack's shape ((sum k, A, B) for pieces); for
        ``Overwrite`` pieces, the pieces themselves, now holding the result (no output buffer)."""
        overwrite = isinstance(mats, Overwrite)
        pieces = batch_pieces(mats, "mats", writable=overwrite)  # (k, A, B) each, checked as newton_schulz does
        first = pieces[0]
        shape = tuple(first.shape[-2:])
        dtype = resolve_dtype(cfg.dtype, first.device, shape) or first.dtype
        total = sum(p.shape[0] for p in pieces)
        out = None if overwrite else torch.empty((total, *shape), dtype=dtype, device=first.device)
        reuses_input = overwrite and first.dtype == dtype
        if total and all(shape):  # matrices with a zero dim: nothing to orthogonalize, no bytes to cut by
            for start, chunk, chunk_cfg in self._sized_chunks(pieces, dtype, cfg, reuses_input):
                dest = chunk if out is None else out[start:start + sum(p.shape[0] for p in chunk)]
                self.ran[shape] = dict(dtype=str(dtype).removeprefix("torch."), form=form_for(chunk_cfg, shape),
                                       backend=chunk_cfg.backend)
                if self.graphs and first.is_cuda:
                    self._graph_for(chunk, chunk_cfg, dtype)(chunk, dest)
                else:
                    newton_schulz(chunk, chunk_cfg, workspace=self.workspace, out=dest)
                self.health.observe(dest)
        if out is None:
            return mats
        return out.view(mats.shape) if isinstance(mats, torch.Tensor) else out

    def _sized_chunks(self, pieces: list[torch.Tensor], dtype: torch.dtype, cfg: NSConfig, reuses_input: bool):
        """(offset, pieces, config) per chunk of the budget's size (``_chunks``), its config naming
        the backend picked for the chunk's own size, so that ``newton_schulz`` runs the backend the
        chunk was checked against. "auto" may pick either for different batch sizes (and chunks are
        cut smaller than the budget's count, evenly): a chunk sized for the torch path that would
        run on Triton, which holds one m x n more per matrix, is cut again at Triton's count.
        ``matrices_within`` already counts Triton's bytes wherever "auto" may pick it; this keeps
        the runner's budget whatever picker answers (a timing cache, a test's stand-in)."""
        first = pieces[0]
        shape, device = tuple(first.shape[-2:]), first.device
        m, n = sorted(shape)
        total = sum(p.shape[0] for p in pieces)

        def within(c: NSConfig) -> int:
            return self.chunk_size(shape, dtype, reuses_input, c, device, input_dtype=first.dtype)

        def picks(step: int) -> dict[int, str]:  # {chunk size: backend} for the sizes `_chunks` cuts
            size, extra = _even_sizes(total, step)
            return {k: pick_backend(cfg.backend, device, (k, m, n), dtype, cfg)
                    for k in ((size, size + 1) if extra else (size,))}

        # the same batch at every step: its sizing, checked configs and picks are made once
        key = (shape, dtype, first.dtype, device, cfg, reuses_input, total, self.budget_bytes)
        sized = self._sized.get(key)
        if sized is None:
            step = within(cfg)
            backend_of = picks(step)
            configs = _fixed(cfg, backend_of.values())
            fits = min(within(c) for c in configs.values())
            if max(backend_of.keys()) > fits:  # a chunk larger than its picked backend fits
                step = fits
                backend_of = picks(step)
                configs = _fixed(cfg, backend_of.values())
            sized = self._sized[key] = (step, backend_of, configs)
        step, backend_of, configs = sized
        for start, chunk in _chunks(pieces, step):
            yield start, chunk, configs[backend_of[sum(p.shape[0] for p in chunk)]]

    def _graph_for(self, chunk: list[torch.Tensor], cfg: NSConfig, dtype: torch.dtype) -> _Graphed:
        first = chunk[0]
        key = (sum(p.shape[0] for p in chunk), tuple(first.shape[-2:]), first.dtype, first.device, cfg, dtype)
        if key not in self._graphed:
            self._graphed[key] = _Graphed(chunk, cfg, dtype)
        return self._graphed[key]

    @property
    def nbytes(self) -> int:
        """Bytes held between steps: the shared workspace and every graph's static buffers."""
        graphed = sum(g.input.nbytes + g.output.nbytes + g.workspace.nbytes for g in self._graphed.values())
        return self.workspace.nbytes + graphed

    def __getstate__(self):
        # buffers, graphs and the health counters are scratch
        return dict(budget_bytes=self.budget_bytes, graphs=self.graphs)

    def __setstate__(self, state):
        self.__init__(state["budget_bytes"], graphs=state["graphs"])
