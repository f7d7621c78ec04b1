"""``NSConfig``, the Newton-Schulz settings a batch of matrices shares; which form runs on a
shape under it (``form_for``) and what that costs (``ns_flops``). Pure functions of the config
and the shape: the device's rules (dtypes, backends) are ``newton_schulz``'s, each backend's
facts its record's (``backends``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import torch

from .backends import AUTO, BACKENDS, check_backend_name
from .coefficients import Coefficients, coefficient_table, resolve_coefficients, schedule_of
from .forms import FORMS, PLAIN
from .forms.gram import GRAM_DTYPES, checked_restarts, restarts_in
from .precision import NS_DTYPES, is_number

FORM_NAMES = tuple(FORMS)
"""The registered forms' names, in registry order (``NSConfig.form``)."""


@dataclass(frozen=True, kw_only=True)
class NSConfig:
    """The Newton-Schulz settings a batch of matrices shares; hashable, so it keys plan batches."""

    steps: int = 5
    """Number of iterations."""
    coefficients: str | tuple[tuple[float, float, float], ...] = "keller"
    """A schedule's name (``muonlab.kernels.schedules.SCHEDULES``: "keller", "xtuner",
    "polar_express", ...), per-iteration (a, b, c) tuples, or one (a, b, c) used at every step
    (torch.optim.Muon's format); stored as a tuple of triples."""
    eps: float = 1e-7
    """Floor on each matrix's norm, so an all-zero matrix maps to zero instead of NaN."""
    dtype: torch.dtype | str | None = "auto"
    """Compute dtype: "auto" (bf16 on CUDA, like torch.optim.Muon; on a CPU bf16 only where it has
    native bf16 matmul, else fp32, see ``resolve_dtype``), a torch dtype, or None (the input's)."""
    form: str = "plain"
    """A registered form (``muonlab.kernels.forms.FORMS``): "plain" or "gram" (fewer FLOPs on
    rectangular matrices; see its module). Square matrices always take the plain form: there gram
    saves nothing and costs about 20% more."""
    backend: str = "auto"
    """A registered backend (``muonlab.kernels.backends.BACKENDS``): "torch", "triton" (CUDA + triton
    required; fp32, fp16 or bf16 only, ``TRITON_DTYPES``); or "auto": per shape, whichever of those
    that may run was measured faster on this device (muonlab.kernels.backend_choice); torch off
    CUDA, under the Triton interpreter, and for other dtypes (fp64)."""
    gram_restarts: tuple[int, ...] | None = None
    """Iterations after which the gram form recomputes R from X. None: ``DEFAULT_GRAM_RESTARTS``
    for the dtype it iterates in (``restarts_in``)."""
    gram_min_saving: float | None = None
    """With a form other than "plain": take it only on shapes where it saves at least this share
    of the plain form's FLOPs, the plain form elsewhere (None: on every shape it runs on). Muon's
    ``ns_form="auto"`` sets it (see ``resolve_form``); the plain form is then also taken where the
    schedule may not run in the form."""
    gram_dtype: torch.dtype | None = None
    """The dtype the gram form iterates in: None picks it from the compute dtype and the device
    (``gram_work_dtype``: fp16 for a 16-bit compute dtype where the device multiplies fp16
    natively, else fp32; fp32 and fp64 as they are); or fp16, fp32, fp64. Never bf16, in which the
    gram form diverges (see ``muonlab.kernels.forms.gram``)."""

    def __post_init__(self):
        check_backend_name(self.backend)
        if self.form not in FORMS:
            raise ValueError(f"unknown Newton-Schulz form {self.form!r} (Muon's ns_form); choose one of {FORM_NAMES}")
        if self.dtype is not None and self.dtype != "auto" and not isinstance(self.dtype, torch.dtype):
            raise TypeError(f'Newton-Schulz dtype must be a torch.dtype, "auto" or None (Muon\'s ns_dtype), '
                            f"got {self.dtype!r}")
        if isinstance(self.dtype, torch.dtype) and self.dtype not in NS_DTYPES:
            raise ValueError(f"Newton-Schulz dtype (Muon's ns_dtype) must be one of {list(NS_DTYPES)} or None, "
                             f"got {self.dtype}")
        backend = None if self.backend == AUTO else BACKENDS[self.backend]
        if backend is not None and isinstance(self.dtype, torch.dtype) and not backend.takes(self.dtype):
            raise ValueError(backend.dtype_message(self.dtype))
        if not is_number(self.eps):
            raise TypeError(f"Newton-Schulz eps must be a number, got {self.eps!r}")
        if not self.eps > 0:  # a zero floor divides an all-zero matrix by zero
            raise ValueError(f"Newton-Schulz eps must be > 0, got {self.eps!r}")
        resolve_coefficients(self.coefficients, self.steps)  # raises on bad steps or coefficients
        # explicit coefficients become a tuple of triples: the config stays hashable, and one bare
        # triple equals the same triple in a list (one batch key)
        object.__setattr__(self, "coefficients", coefficient_table(self.coefficients))
        if self.gram_restarts is not None:
            object.__setattr__(self, "gram_restarts", checked_restarts(self.gram_restarts))
        if self.gram_dtype is not None and self.gram_dtype not in GRAM_DTYPES:
            raise ValueError(f"gram_dtype must be None or one of {list(GRAM_DTYPES)}, got {self.gram_dtype!r}: "
                             "the gram form diverges in bf16 on near-low-rank matrices (use form='plain' "
                             "for bf16 iterates)")
        if self.gram_min_saving is not None and not (is_number(self.gram_min_saving)
                                                     and 0 <= self.gram_min_saving < 1):
            raise ValueError(f"gram_min_saving must be None or a share in [0, 1), got {self.gram_min_saving!r}")
        self._check_schedule()

    def _check_schedule(self) -> None:
        """Refuse a schedule where the config alone tells it may not run, the same on every
        device: too few steps, a form asked for outright, and any dtype that form could iterate
        in under this config on some device ("auto" means bf16 on a GPU). Under
        ``gram_min_saving`` the form depends on the shape (``_form`` keeps the plain form where
        the schedule may not run in the other). With ``dtype=None`` (the input's)
        ``newton_schulz`` checks once it sees the input, before anything is written."""
        schedule = schedule_of(self.coefficients)
        if schedule is None:
            return
        asked = self.form if self.gram_min_saving is None else PLAIN
        schedule.check(asked, None, self.steps)
        if self.dtype is not None:
            for dtype in sorted(_iterate_dtypes(self, FORMS[asked]), key=str):
                schedule.check(asked, dtype)

    def resolved_coefficients(self) -> Coefficients:
        return resolve_coefficients(self.coefficients, self.steps)

    def restarts_in(self, dtype: torch.dtype | None) -> tuple[int, ...]:
        """The gram form's restarts when it iterates in ``dtype`` (None: fp16, a GPU's)."""
        return restarts_in(self, dtype)


def _config(config: NSConfig | None, settings: dict) -> NSConfig:
    """``config`` with keyword overrides (the fields of NSConfig), or a new one from them."""
    unknown = sorted(set(settings) - {f.name for f in fields(NSConfig)})
    if unknown:
        raise TypeError(f"unknown Newton-Schulz setting(s) {unknown}; NSConfig has {[f.name for f in fields(NSConfig)]}")
    if config is None:
        return NSConfig(**settings)
    if not isinstance(config, NSConfig):
        raise TypeError(f"config must be an NSConfig, got {type(config).__name__} (pass steps=... by keyword)")
    return replace(config, **settings) if settings else config


def _form(cfg: NSConfig, m: int, n: int) -> str:
    """The form that runs on m x n matrices (m <= n): ``cfg.form`` where it runs on this shape
    (not on square ones for the gram form), and with ``gram_min_saving`` only where it saves that
    share of the plain form's FLOPs and the schedule may run in it; else the plain form."""
    form = FORMS[cfg.form]
    if form.name == PLAIN or (m == n and not form.square_matrices):
        return PLAIN
    if cfg.gram_min_saving is not None:
        plain = FORMS[PLAIN]
        if form.flops(m, n, cfg) > (1 - cfg.gram_min_saving) * plain.flops(m, n, cfg):
            return PLAIN
        if _refused_somewhere(cfg, form):
            return PLAIN
    return form.name


AUTO_COMPUTE_DTYPES = (torch.bfloat16, torch.float32)
"""The compute dtypes ``dtype="auto"`` may resolve to on some device (``resolve_dtype``)."""


def _refused_somewhere(cfg: NSConfig, form) -> bool:
    """Whether the schedule may not run in ``form`` in some dtype the form could iterate in under
    ``cfg`` on some device: then a choice made from the config alone (``gram_min_saving``) keeps
    the plain form, the same on every device and in every plan."""
    schedule = schedule_of(cfg.coefficients)
    if schedule is None:
        return False
    return any(schedule.refusal(form.name, d) is not None for d in _iterate_dtypes(cfg, form))


def _iterate_dtypes(cfg: NSConfig, form) -> set[torch.dtype]:
    """Every dtype ``form`` could iterate in under ``cfg``, on any device, for any input."""
    if isinstance(cfg.dtype, torch.dtype):
        computes = (cfg.dtype,)
    else:
        computes = AUTO_COMPUTE_DTYPES if cfg.dtype == "auto" else NS_DTYPES
    return {form.work_dtype(cfg, d, native) for d in computes for native in (True, False)}


def form_for(cfg: NSConfig, shape: Sequence[int]) -> str:
    """The form ``newton_schulz`` runs under ``cfg`` on matrices of ``shape`` (its last two dims)."""
    m, n = sorted(int(d) for d in shape[-2:])
    return _form(cfg, m, n)


def ns_flops(shape: Sequence[int], config: NSConfig | None = None, **settings) -> int:
    """FLOPs (multiply-adds count 2) of ``newton_schulz`` on a tensor of ``shape`` under a config:
    the form that runs on it (``form_for``), its ``flops`` with m = min, n = max of the last two
    dims. A backend with symmetric products ("triton"): their count (``symmetric_flops_per_iter``
    for the plain form); "auto" counts as torch (it picks Triton only on CUDA, which a plan made
    from shapes cannot know)."""
    cfg = _config(config, settings)
    if len(shape) < 2:
        raise ValueError(f"ns_flops needs a shape with at least 2 dims, got {tuple(shape)}")
    batch = 1
    for d in shape[:-2]:
        batch *= int(d)
    m, n = sorted((int(shape[-2]), int(shape[-1])))
    return batch * FORMS[_form(cfg, m, n)].flops(m, n, cfg, symmetric=_symmetric(cfg.backend))


def _symmetric(backend: str) -> bool:
    return backend != AUTO and BACKENDS[backend].symmetric_products
