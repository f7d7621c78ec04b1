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

A plan runs the same batches every step, so the runner makes its choices once per batch key (the
compute dtype, the form and its iterates' dtype, the chunks, each chunk size's backend, the
resolved coefficients: ``_Decided``) and runs each chunk straight on the executor
(``execute.run_resolved``): a call then makes the same number of Python calls whatever the number
of pieces it is handed, plus a few per chunk.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .backends import AUTO, FALLBACK
from .health import UpdateHealth
from .batch_io import Overwrite, batch_pieces
from .config import NSConfig, form_for
from .execute import ResolvedRun, joined, load_pieces, resolve, run_resolved, store_pieces
from .newton_schulz import checked_form, compute_dtype, pick_backend, possible_backends, resolve_dtype, work_dtype
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

    On a ``device``, the fewest over the backends ``cfg``'s may run (``possible_backends``: for
    ``"auto"`` where Triton can run, both, its pick being timed per batch size, and a plan or a
    runner cuts batches smaller than this count, evenly): one for which any of them stays within
    the budget whatever "auto" picks (Triton's wide iterates take one m x n more per matrix); the
    count then depends on no timing, so every rank plans the same batches. Without a device
    (``muonlab.simulate``), a named backend's bytes, as every run it can make takes (where it
    can't run, a run is refused), and for ``"auto"`` the torch path's: its choice is made on the
    device itself."""
    form = "plain" if cfg is None else form_for(cfg, shape)
    if cfg is None or (device is None and cfg.backend == AUTO):
        backends = (FALLBACK,)
    elif device is None:
        backends = (cfg.backend,)
    else:
        backends = possible_backends(cfg.backend, device, dtype)
    input_itemsize = None if input_dtype is None else input_dtype.itemsize
    # the iterates' own bytes where the form iterates in another dtype (the gram form's fp16 or fp32)
    work_itemsize = None if cfg is None else work_dtype(cfg, form, dtype, device).itemsize
    return min([max_batch_matrices(shape, dtype.itemsize, budget_bytes, reuses_input, form, backend=b,
                                   input_itemsize=input_itemsize, work_itemsize=work_itemsize) for b in backends])


def _even_sizes(total: int, size: int) -> tuple[int, int]:
    """``_chunks``' split of ``total`` matrices under ``size``: (matrices per chunk, how many of
    the first chunks take one more)."""
    return divmod(total, max(1, -(-total // size)))


def _chunks(pieces: list[torch.Tensor], size: int):
    """(offset, pieces) per run of at most ``size`` matrices over the concatenation of ``pieces``
    (each (k_i, A, B)), as even as can be (64 under 30 as 22+21+21: fewer distinct shapes for the
    matmul library); a piece crossing a boundary is cut into views."""
    size, extra = _even_sizes(sum([p.shape[0] for p in pieces]), size)
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


def _step_pieces(mats) -> list[torch.Tensor] | None:
    """What ``batch_pieces`` makes of the batches a step's paths hand over, without its calls: a
    (k, A, B) stack, or (k_i, A, B) pieces of one kind (device, dtype, matrix shape) with matrices,
    joined where they lie back to back; None for anything else (``batch_pieces`` then checks it)."""
    if type(mats) is torch.Tensor:
        return [mats] if mats.ndim == 3 and mats.numel() else None
    if type(mats) is not Overwrite and type(mats) is not list or not mats:
        return None
    kinds = {(type(p), p.ndim, p.shape[-2:], p.device, p.dtype, not p.numel()) if isinstance(p, torch.Tensor)
             else None for p in mats}
    if len(kinds) != 1 or kinds.pop() != (torch.Tensor, 3, mats[0].shape[-2:], mats[0].device, mats[0].dtype, False):
        return None
    return joined(mats)


def _fixed(cfg: NSConfig, backends) -> dict[str, NSConfig]:
    """{backend: ``cfg`` running on it} for each of ``backends``."""
    return {b: cfg if b == cfg.backend else replace(cfg, backend=b) for b in set(backends)}


@dataclass(frozen=True, eq=False)
class _Decided:
    """The runner's choices for one batch key (``NewtonSchulzRunner._decide``)."""

    cfg: NSConfig
    """The config decided for (the key holds its id: hashing a dataclass is a Python call)."""
    dtype: torch.dtype
    """The compute dtype: the output's."""
    step: int
    """Matrices per chunk, as ``_chunks`` takes it."""
    runs: dict[int, ResolvedRun]
    """{chunk size: its run}, on the backend picked for that size."""
    ran: dict[int, dict[str, str]]
    """{chunk size: its ``NewtonSchulzRunner.ran`` entry}."""


class _Graphed:
    """One chunk shape's Newton-Schulz captured in a CUDA graph, with its static buffers."""

    def __init__(self, chunk: list[torch.Tensor], num: int, run: ResolvedRun, dtype: torch.dtype):
        first = chunk[0]
        shape = (num, *first.shape[-2:])
        self.input = torch.empty(shape, dtype=first.dtype, device=first.device)
        self.output = torch.empty(shape, dtype=dtype, device=first.device)
        self.workspace = Workspace()  # its own: graph buffers must not move
        load_pieces(self.input, chunk)
        side = torch.cuda.Stream(first.device)
        side.wait_stream(torch.cuda.current_stream(first.device))
        with torch.cuda.stream(side):  # warm-up off the capture (autotune, allocator)
            run_resolved([self.input], [self.output], run, self.workspace)
        torch.cuda.current_stream(first.device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            run_resolved([self.input], [self.output], run, self.workspace)

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
        self._decided: dict[tuple, _Decided] = {}
        """``_decide``'s choices per batch key."""
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
        if torch.is_grad_enabled():  # an optimizer's transform, written in place: no autograd graph
            with torch.no_grad():
                return self(mats, cfg)
        overwrite = isinstance(mats, Overwrite)
        pieces = _step_pieces(mats)
        if pieces is None:  # anything else: checked (and reshaped) as newton_schulz does
            pieces = batch_pieces(mats, "mats", writable=overwrite)
        first = pieces[0]
        shape = tuple(first.shape[-2:])
        # lists, not generators, here and per chunk: a generator is a Python call per item
        total = sum([p.shape[0] for p in pieces])
        if not (total and all(shape)):  # matrices with a zero dim: nothing to orthogonalize, no bytes to cut by
            if overwrite:
                return mats
            dtype = resolve_dtype(cfg.dtype, first.device, shape) or first.dtype
            out = torch.empty((total, *shape), dtype=dtype, device=first.device)
            return out.view(mats.shape) if isinstance(mats, torch.Tensor) else out
        key = (shape, first.dtype, first.device, id(cfg), overwrite, total, self.budget_bytes)
        decided = self._decided.get(key)
        # the same batch at every step (a plan's config object): its choices are made once; an id
        # reused by another config after the first was freed is told apart by identity
        if decided is None or decided.cfg is not cfg:
            decided = self._decided[key] = self._decide(first, cfg, overwrite, total)
        out = None if overwrite else torch.empty((total, *shape), dtype=decided.dtype, device=first.device)
        graphed = self.graphs and first.is_cuda
        # one chunk (a plan's batches are cut by the same budget): the pieces as they are, joined
        whole = decided.step >= total
        for start, chunk in ((0, pieces),) if whole else _chunks(pieces, decided.step):
            num = total if whole else sum([p.shape[0] for p in chunk])
            run = decided.runs[num]
            self.ran[shape] = decided.ran[num].copy()
            if not whole and len(chunk) > 1:  # as newton_schulz reads a list: pieces back to back as one
                chunk = joined(chunk)
            dest = chunk if out is None else out[start:start + num]
            if graphed:
                self._graph_for(chunk, num, run, decided.dtype)(chunk, dest)
            else:
                run_resolved(chunk, chunk if out is None else [dest], run, self.workspace)
            self.health.observe(dest)
        if out is None:
            return mats
        return out.view(mats.shape) if isinstance(mats, torch.Tensor) else out

    def _decide(self, first: torch.Tensor, cfg: NSConfig, overwrite: bool, total: int) -> _Decided:
        """The choices for a batch of ``total`` matrices like ``first`` under ``cfg``, with
        ``newton_schulz``'s errors, raised before anything is timed or written: the compute dtype,
        the form and its iterates' dtype (where the schedule is checked), the chunks of the
        budget's size (``_chunks``), and per chunk size the backend picked for that size and its
        resolved run, so that a chunk runs the backend it was sized for. "auto" may pick either
        for different batch sizes (and chunks are cut smaller than the budget's count, evenly): a
        chunk sized for the torch path that would run on Triton, which holds one m x n more per
        matrix, is cut again at Triton's count. ``matrices_within`` already counts Triton's bytes
        wherever "auto" may pick it; this keeps the runner's budget whatever picker answers (a
        timing cache, a test's stand-in)."""
        shape, device = tuple(first.shape[-2:]), first.device
        dtype = compute_dtype(cfg, device, shape, first.dtype)
        possible_backends(cfg.backend, device, dtype)  # a backend that can't run there: refused first
        form, iterates = checked_form(cfg, shape, dtype, device)
        reuses_input = overwrite and first.dtype == dtype
        m, n = sorted(shape)

        def within(c: NSConfig) -> int:
            return self.chunk_size(shape, dtype, reuses_input, c, device, input_dtype=first.dtype)

        def picks(step: int) -> dict[int, str]:  # {chunk size: backend} for the sizes `_chunks` cuts
            size, extra = _even_sizes(total, step)
            return {k: pick_backend(cfg.backend, device, (k, m, n), dtype, cfg)
                    for k in ((size, size + 1) if extra else (size,))}

        step = within(cfg)
        backend_of = picks(step)
        configs = _fixed(cfg, backend_of.values())
        fits = min(within(c) for c in configs.values())
        if max(backend_of.keys()) > fits:  # a chunk larger than its picked backend fits
            step = fits
            backend_of = picks(step)
            configs = _fixed(cfg, backend_of.values())
        runs = {b: resolve(c, form=form, backend=b, dtype=iterates) for b, c in configs.items()}
        name = str(dtype).removeprefix("torch.")
        return _Decided(cfg=cfg, dtype=dtype, step=step, runs={k: runs[b] for k, b in backend_of.items()},
                        ran={k: dict(dtype=name, form=form, backend=b) for k, b in backend_of.items()})

    def _graph_for(self, chunk: list[torch.Tensor], num: int, run: ResolvedRun, dtype: torch.dtype) -> _Graphed:
        first = chunk[0]
        key = (num, tuple(first.shape[-2:]), first.dtype, first.device, run.cfg, dtype)
        if key not in self._graphed:
            self._graphed[key] = _Graphed(chunk, num, run, dtype)
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
