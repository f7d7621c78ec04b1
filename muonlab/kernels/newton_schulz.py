"""Newton-Schulz orthogonalization: the entry point, and the device's rules behind its choices.

Muon replaces a matrix update G = U S V^T by (approximately) U V^T. A few iterations of the odd
polynomial X <- a X + b (X X^T) X + c (X X^T)^2 X push every singular value of a normalised X
towards 1 without an SVD (Keller Jordan, "Muon: An optimizer for hidden layers", 2024).

What a call runs is made of registered units, each one module:

* a coefficient schedule (``muonlab.kernels.schedules``: keller, xtuner, polar_express, ...),
  with its source and where it may run;
* a form (``muonlab.kernels.forms``): "plain", the iteration on X, or "gram", the same iteration
  on X X^T (fewer FLOPs on rectangular matrices; never in bf16), each with its workspace, FLOP
  count and dtypes;
* a backend (``muonlab.kernels.backends``): torch, or the Triton kernels
  (``triton_newton_schulz``), each with where it can run and the dtypes it takes; "auto" picks
  one per shape (``backend_choice``).

This module holds the choices that depend on the device: the compute dtype "auto" means
(``resolve_dtype``, ``compute_dtype``), the form and the dtype it iterates in (``resolve_form``,
``checked_form``, ``work_dtype``), and the backends that can run (``possible_backends``,
``pick_backend``, over the backends' records). ``newton_schulz`` makes them on every call and
hands the batch to ``execute.run``; the runner (``runner``) makes them once per batch key, with
the same functions, and runs each chunk on the result (``execute.run_resolved``). The settings
are ``config.NSConfig``'s, the batch I/O ``batch_io``'s.

Both forms work on any leading batch dims (one matrix per expert); each matrix is normalised by
its own Frobenius norm, never across the batch.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from . import backend_choice, execute
from .backends import AUTO, BACKENDS, FALLBACK, check_backend_name
from .batch_io import Overwrite, batch_pieces
from .coefficients import schedule_of
from .config import FORM_NAMES, NSConfig, _config, _form
from .forms import FORMS
from .forms import gram as _gram
# owned by forms.plain; importable from here too, as notebooks/04_kernels.ipynb imports them
from .forms.plain import plain_flops_per_iter, symmetric_flops_per_iter  # noqa: F401
from .precision import NS_DTYPES

__all__ = [
    "AUTO_GRAM_SAVING", "BF16_CPU_FLAGS", "CPU_FP32_MAX_WORK", "FORM_CHOICES", "FP16_CPU_FLAGS", "checked_form",
    "compute_dtype", "cpu_bf16_flags", "cpu_flags", "cpu_has_native_bf16", "default_gram_dtype", "gram_work_dtype",
    "native_fp16_matmul", "newton_schulz", "pick_backend", "possible_backends", "resolve_dtype", "resolve_form",
    "work_dtype",
]


AUTO_GRAM_SAVING = 0.2
"""Where ``ns_form="auto"`` takes the gram form: shapes on which it saves at least 20% of the plain
form's FLOPs, and only where its iterates (``gram_work_dtype``) are no wider than the compute
dtype (see ``resolve_form``).

Time. On an H100 (benchmarks/results/gpu_step.md, bf16 compute, torch backend, measured while the
gram form still iterated in bf16; fp16 runs at the same tensor-core rate) the gram form ran the 1B
set (2048 x 6144 and 2048 x 8192: 26% and 33% fewer FLOPs) 1.29x faster than the plain form, the
GPT-2 set 1.17x and the (128, 768, 2048) bank (22% fewer) 1.18x; the (64, 1408, 2048) bank, where
it saves nothing (-1%), 5% slower. On CPUs the gram form in fp32 made a whole fp32 Muon step
1.27-1.28x faster (benchmarks/results/optimizer_step.md, gpu_step_cpu_proxy.md); a 16-bit step on
a CPU without fp16 matmul keeps the plain form.

Accuracy. Ten Muon steps on (64, 64), (32, 96), (96, 32), (48, 80), (64, 512) and (512, 64)
against an fp64 run (tests/unit/test_ns_accuracy.py, every schedule, random and near-rank-2
gradients): the default's worst relative error is 0.83-1.00x the plain form's in bf16 (the gram
form in fp16 under the GPU rule) and 0.73-1.25x in fp32; the test holds it within 1.5x. The gram
form in bf16, as it was until 2026-11-26, was 3.6x as far (random gradients, Keller) and 2,200x
(Polar Express, near-rank-2 gradients: it diverged).

Bits. The plain form computes torch.optim.Muon's iteration; one matrix at a time (a batch of one)
it gives torch's bits. Batched, the CPU's batched products may round differently from one matrix's
(bf16, four 16 x 32 matrices: one draw in 50 differed in the last bits), and over a run the
differences grow (2.3e-3 off torch.optim.Muon after 30 steps in one measured case)."""

FORM_CHOICES = ("auto", *FORM_NAMES)


def resolve_form(form: str, dtype: torch.dtype | str | None = "auto", device: torch.device | str | None = None) -> dict:
    """NSConfig settings for Muon's ``ns_form``: "plain" and "gram" as they are; "auto" the gram
    form on shapes where it saves ``AUTO_GRAM_SAVING`` of the FLOPs, the plain form elsewhere. And
    the plain form everywhere where the gram form would iterate in a wider dtype than the compute
    dtype ``dtype`` resolves to on ``device`` (a 16-bit dtype on a CPU without native fp16 matmul:
    ``default_gram_dtype``), which would make it slower, not faster. Without a device (a plan made
    from shapes, ``muonlab.simulate``), the GPU rule."""
    if form not in FORM_CHOICES:
        raise ValueError(f"unknown Newton-Schulz form {form!r} (Muon's ns_form); choose one of {FORM_CHOICES}")
    if form != "auto":
        return dict(form=form)
    compute = resolve_dtype(dtype, device) if device is not None else None
    if compute is not None and default_gram_dtype(compute, device).itemsize > compute.itemsize:
        return dict(form="plain")
    return dict(form="gram", gram_min_saving=AUTO_GRAM_SAVING)


def possible_backends(backend: str, device: torch.device | str, dtype: torch.dtype | None = None) -> tuple[str, ...]:
    """The backends ``backend`` may run a batch on ``device`` on, whatever the batch's shape: one,
    or for "auto" ``FALLBACK`` and every registered backend whose record lets "auto" pick it there
    (``NSBackend.auto_may_pick``: compiled Triton on CUDA; its pick then depends on the batch's
    shape, see ``pick_backend``). ``dtype``, the compute dtype, if known: "auto" offers a backend
    only for the dtypes it takes. ValueError for a name neither "auto" nor registered, and for a
    backend that can't run on ``device`` or can't take ``dtype``."""
    check_backend_name(backend)
    device = torch.device(device)
    if backend != AUTO:
        record = BACKENDS[backend]
        if not record.takes(dtype):
            raise ValueError(record.dtype_message(dtype))
        refusal = record.refusal(device)
        if refusal is not None:
            raise ValueError(refusal)
        return (backend,)
    return (FALLBACK, *[name for name, record in BACKENDS.items()
                        if name != FALLBACK and record.auto_may_pick(device, dtype)])


def pick_backend(backend: str, device: torch.device | str, batch_shape: tuple[int, int, int], dtype: torch.dtype,
                 cfg: NSConfig) -> str:
    """The registered backend ``backend`` runs a (B, m, n) batch of ``dtype`` on ``device`` on;
    ValueError as ``possible_backends`` (an unknown name, a backend that can't run there or can't
    take ``dtype``)."""
    possible = possible_backends(backend, device, dtype)
    if len(possible) == 1:
        return possible[0]
    return backend_choice.faster_backend(batch_shape, dtype, cfg, torch.device(device))


CPU_FP32_MAX_WORK = 2**17
"""On a CPU with native bf16 matmul, "auto" still computes a matrix in fp32 when its m^2 n (m its
smaller side, n its larger: one product's multiply-adds) is at most this: there a bf16 product's
fixed cost (oneDNN's, per call) outweighs its arithmetic. Measured on an AVX512-BF16 CPU, batches
of 12 (benchmarks/results/cpu_dtype.md): fp32 faster up to it, bf16 from the next size measured on.
"""


def resolve_dtype(dtype: torch.dtype | str | None, device: torch.device,
                  matrix_shape: Sequence[int] | None = None) -> torch.dtype | None:
    """The compute dtype "auto" means on ``device`` (for a matrix of ``matrix_shape``, when given):
    bf16 on CUDA (tensor cores, as torch.optim.Muon uses); on a CPU bf16 only where it lists
    native bf16 matmul (AVX512_BF16 or AMX-BF16), and there only for matrices larger than
    ``CPU_FP32_MAX_WORK``: without native bf16, matmul is emulated at about a third of fp32's
    rate, and small products are faster in fp32 either way, so fp32 is both faster and more
    accurate there. Other values pass through."""
    if dtype != "auto":
        return dtype
    if torch.device(device).type == "cpu":
        if not cpu_has_native_bf16():
            return torch.float32
        if matrix_shape is not None:
            m, n = sorted(int(d) for d in matrix_shape[-2:])
            if m * m * n <= CPU_FP32_MAX_WORK:
                return torch.float32
        return torch.bfloat16
    return torch.bfloat16


BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")
FP16_CPU_FLAGS = ("avx512_fp16", "amx_fp16")


def native_fp16_matmul(device: torch.device | str | None) -> bool:
    """Whether ``device`` multiplies fp16 matrices natively: CUDA, and CPUs listing
    ``FP16_CPU_FLAGS``. None (a plan made without a device, ``muonlab.simulate``): as on a GPU."""
    if device is None or torch.device(device).type != "cpu":
        return True
    return bool(cpu_flags(FP16_CPU_FLAGS))


def default_gram_dtype(dtype: torch.dtype, device: torch.device | str | None) -> torch.dtype:
    """The dtype the gram form iterates in by default for compute dtype ``dtype`` on ``device``
    (None: the GPU rule): fp16 for a 16-bit compute dtype where the device multiplies fp16
    natively, fp32 where it doesn't; fp32 and fp64 as they are (``forms.gram.default_work_dtype``)."""
    return _gram.default_work_dtype(dtype, native_fp16_matmul(device))


def work_dtype(cfg: NSConfig, form: str, dtype: torch.dtype, device: torch.device | str | None) -> torch.dtype:
    """The dtype ``form`` iterates in under ``cfg`` for compute dtype ``dtype`` on ``device``
    (None: the GPU rule): the form's ``work_dtype`` with the device's fp16 fact."""
    return FORMS[form].work_dtype(cfg, dtype, native_fp16_matmul(device))


def gram_work_dtype(cfg: NSConfig, dtype: torch.dtype, device: torch.device | str | None) -> torch.dtype:
    """The dtype the gram form iterates in under ``cfg``: its ``gram_dtype`` if set, else
    ``default_gram_dtype``."""
    return work_dtype(cfg, "gram", dtype, device)


@functools.cache
def cpu_flags(wanted: tuple[str, ...]) -> tuple[str, ...] | None:
    """Which of ``wanted`` /proc/cpuinfo lists; None where it can't be read or lists no flags."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split() for line in f if line.startswith("flags")), None)
    except OSError:
        return None
    return None if flags is None else tuple(f for f in wanted if f in flags)


def cpu_bf16_flags() -> tuple[str, ...] | None:
    """Which of ``BF16_CPU_FLAGS`` (native bf16 matmul) /proc/cpuinfo lists (None: unreadable)."""
    return cpu_flags(BF16_CPU_FLAGS)


def cpu_has_native_bf16() -> bool:
    return bool(cpu_bf16_flags())


@torch.no_grad()  # an optimizer's transform, written in place: no autograd graph, a Parameter reads as data
def newton_schulz(G: torch.Tensor | Sequence[torch.Tensor], config: NSConfig | None = None, *, workspace=None,
                  out: torch.Tensor | Sequence[torch.Tensor] | None = None, **settings):
    """Approximately orthogonalize the last two dims of ``G`` (batched over leading dims).

    Args:
        G: tensor with at least 2 dims; leading dims are a batch of independent matrices. Or a
            list of such tensors with equal last two dims, taken as their concatenation along the
            batch: a plan batch's matrices are read straight into the workspace, never stacked
            into a copy of their own first.
        config: the settings (``NSConfig``); keyword ``settings`` (its field names: steps,
            coefficients, eps, dtype, form, backend, gram_restarts) override or replace it.
        workspace: a ``muonlab.kernels.workspace.Workspace`` whose buffers hold the iterates, so
            repeated calls reuse memory instead of allocating; None allocates per call.
        out: where to write the result: a tensor or a list of tensors holding as many matrices as
            G (any float dtype: the result is cast into it). It may be G itself: G is read before
            anything is written. A contiguous tensor in the compute dtype serves as one of the two
            iterate buffers (the plain torch form), so the result needs no copy. None: G itself
            when G is an ``Overwrite`` list, else a new tensor.

    Returns:
        ``out``, or a new contiguous tensor of G's shape ((total, A, B) for a list) in the
        config's dtype (G's dtype when dtype is None). G is not modified unless it is ``out``.
    """
    pieces = batch_pieces(G)
    cfg = _config(config, settings)
    first = pieces[0]
    device = first.device
    dtype = compute_dtype(cfg, device, first.shape, first.dtype)
    possible_backends(cfg.backend, device, dtype)  # a backend that can't run: refused first, even for no matrices
    rows, cols = first.shape[-2:]
    num = sum([p.shape[0] for p in pieces])
    if out is None:
        out = G if isinstance(G, Overwrite) else torch.empty(
            G.shape if isinstance(G, torch.Tensor) else (num, rows, cols), dtype=dtype, device=device)
    targets = batch_pieces(out, "out", writable=True)
    if sum([t.shape[0] for t in targets]) != num or targets[0].shape[-2:] != first.shape[-2:] \
            or targets[0].device != device or not targets[0].is_floating_point():
        raise ValueError(f"out must hold {num} matrices of shape {(rows, cols)} on {device} in a float dtype, "
                         f"like G; got {[tuple(t.shape) for t in targets]} of {targets[0].dtype} on {targets[0].device}")
    if num == 0 or rows == 0 or cols == 0:
        return out
    form, iterates = checked_form(cfg, (rows, cols), dtype, device)
    m, n = sorted((rows, cols))
    use = pick_backend(cfg.backend, device, (num, m, n), dtype, cfg)
    execute.run(pieces, targets, cfg, form=form, backend=use, dtype=iterates, workspace=workspace)
    return out


def compute_dtype(cfg: NSConfig, device: torch.device, matrix_shape: Sequence[int],
                  input_dtype: torch.dtype) -> torch.dtype:
    """The dtype a batch of ``input_dtype`` matrices of ``matrix_shape`` computes in on ``device``
    under ``cfg`` (``resolve_dtype``; the input's for ``dtype=None``); TypeError where it is not
    one of ``NS_DTYPES``."""
    dtype = resolve_dtype(cfg.dtype, device, matrix_shape) or input_dtype
    if dtype not in NS_DTYPES:  # dtype=None computes in G's dtype
        raise TypeError(f"G has dtype {input_dtype}; with dtype=None Newton-Schulz computes in G's dtype, "
                        f"which must be one of {list(NS_DTYPES)} (or pass dtype=)")
    return dtype


def checked_form(cfg: NSConfig, matrix_shape: Sequence[int], dtype: torch.dtype,
                 device: torch.device | str | None) -> tuple[str, torch.dtype]:
    """(the form, the dtype it iterates in) for matrices of ``matrix_shape`` (no dim zero) in
    compute dtype ``dtype`` on ``device``; ValueError where the schedule may not run there,
    raised before anything is timed or written."""
    m, n = sorted(matrix_shape[-2:])
    form = _form(cfg, m, n)
    iterates = work_dtype(cfg, form, dtype, device)  # the gram form's is never bf16 (forms.gram)
    schedule = schedule_of(cfg.coefficients)
    if schedule is not None:
        schedule.check(form, iterates, cfg.steps)
    return form, iterates
