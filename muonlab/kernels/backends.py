"""The Newton-Schulz backends: one record each, and ``BACKENDS``, the only registry of them.

A backend is where a form's products run: torch's batched matmuls, or the Triton kernels
(``triton_newton_schulz``), whose symmetric products compute only upper tiles. Its record says
where it can run, the compute dtypes it takes, and how the executor hands it a batch; every
backend check (``newton_schulz.possible_backends``, the runner's budget, the "auto" timing, the
FLOP model, ``NSConfig``) reads the record, never the name. ``backend="auto"`` is no backend but a
choice among them, per batch shape (``newton_schulz.pick_backend``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .precision import NS_DTYPES, TRITON_DTYPES

AUTO = "auto"
"""``NSConfig.backend``'s value for a per-shape choice among the registered backends."""
FALLBACK = "torch"
"""The backend that runs on every device and dtype: "auto" always offers it, first, and keeps it
on a tie (no compile or tuning risk)."""


def _never_emulated() -> bool:
    return False


@dataclass(frozen=True, kw_only=True)
class NSBackend:
    """The facts of one backend, read by every place that decides where a batch runs."""

    name: str
    dtypes: tuple[torch.dtype, ...]
    """Compute dtypes it takes."""
    kernels: str
    """The kernels a form's ``iterate`` runs its products on here ("torch" or "triton")."""
    wide: bool
    """Whether its kernels take a batch wide ((B, m, n), m <= n) and contiguous: the executor then
    loads a tall batch transposed into two workspace buffers and copies the result out, one m x n
    more per matrix than iterating on the matrices as stored (``batch_bytes_per_matrix``)."""
    symmetric_products: bool
    """Whether its X X^T and A A compute only upper tiles (the FLOP model, ``ns_flops``)."""
    needs: str
    """What it needs to run, in words, for the refusal of ``backend=name`` where it can't."""
    why_not: Callable[[torch.device], str | None]
    """Why it can't run on a device, in words; None where it can."""
    auto_device_types: tuple[str, ...] | None = None
    """Device types "auto" may pick it on (None: any); checked before ``why_not``, which may import
    a large module (triton's import alone costs ~80 MB)."""
    emulated: Callable[[], bool] = _never_emulated
    """Whether it runs emulated now (Triton's interpreter): right, but far too slow to time, so
    "auto" never picks it then; ``backend=name`` still runs it (the CPU tests need it)."""

    def usable(self, device: torch.device | str) -> bool:
        return self.why_not(torch.device(device)) is None

    def takes(self, dtype: torch.dtype | None) -> bool:
        """Whether it takes compute dtype ``dtype`` (None: not known yet, taken)."""
        return dtype is None or dtype in self.dtypes

    def auto_may_pick(self, device: torch.device, dtype: torch.dtype | None) -> bool:
        """Whether "auto" may pick it for a batch of compute dtype ``dtype`` on ``device``."""
        return (self.takes(dtype) and (self.auto_device_types is None or device.type in self.auto_device_types)
                and self.usable(device) and not self.emulated())

    def dtype_message(self, dtype: torch.dtype) -> str:
        return (f"Newton-Schulz dtype {dtype} (Muon's ns_dtype, or the input's dtype with ns_dtype=None) is not "
                f"supported by backend={self.name!r} (Muon's ns_backend): its kernels take {list(self.dtypes)}; "
                f"use backend={FALLBACK!r} or {AUTO!r} for it")

    def refusal(self, device: torch.device) -> str | None:
        """Why ``backend=name`` is refused on ``device``, as the ValueError says it; None where it runs."""
        why = self.why_not(device)
        if why is None:
            return None
        return (f"backend={self.name!r} needs {self.needs}; got device {device}: {why}. "
                f"backend={AUTO!r} falls back to {FALLBACK}")


def why_triton_cannot_run(device: torch.device) -> str | None:
    """Why the Triton kernels can't run on ``device``, in words, or None where they can: triton
    imports and it is CUDA (or the interpreter is on)."""
    try:
        from .triton_newton_schulz import INTERPRET, TRITON_AVAILABLE  # optional: imports triton
    except ImportError as err:  # the kernel module itself failed to import
        return f"the Triton kernels failed to import ({err})"
    if not TRITON_AVAILABLE:
        return "triton is not installed"
    if device.type == "cuda" or (INTERPRET and device.type == "cpu"):
        return None
    if device.type == "cpu":
        return ("Triton compiles for GPUs and runs on a CPU only under its interpreter, and TRITON_INTERPRET=1 was "
                "not set when muonlab was imported")
    return f"Triton runs on CUDA devices, not on {device.type}"


def _triton_interpreted() -> bool:
    from .triton_newton_schulz import INTERPRET  # optional: imports triton (asked only where it can run)

    return INTERPRET


TORCH = NSBackend(name="torch", dtypes=NS_DTYPES, kernels="torch", wide=False, symmetric_products=False,
                  needs="nothing", why_not=lambda device: None)
TRITON = NSBackend(
    name="triton", dtypes=TRITON_DTYPES, kernels="triton", wide=True, symmetric_products=True,
    needs="triton installed and a CUDA tensor (or TRITON_INTERPRET=1 set before muonlab is imported, for CPU tests)",
    why_not=why_triton_cannot_run,
    # the interpreter is for correctness tests only, never picked automatically, not even on CUDA
    # (TRITON_INTERPRET=1 left set while debugging a kernel: timing it would take hours)
    auto_device_types=("cuda",), emulated=_triton_interpreted,
)

BACKENDS: dict[str, NSBackend] = {b.name: b for b in (TORCH, TRITON)}
"""The registered backends by name, ``FALLBACK`` first."""


def backend_choices() -> tuple[str, ...]:
    """The values ``NSConfig.backend`` (Muon's ns_backend) takes: "auto" and every registered backend."""
    return (AUTO, *BACKENDS)


def check_backend_name(name: str) -> None:
    """ValueError for a name that is neither "auto" nor a registered backend (a typo must not
    silently become "auto")."""
    if not (name == AUTO or (isinstance(name, str) and name in BACKENDS)):
        raise ValueError(f"unknown Newton-Schulz backend {name!r} (Muon's ns_backend); "
                         f"choose one of {backend_choices()}")


__all__ = ["AUTO", "BACKENDS", "FALLBACK", "NSBackend", "backend_choices", "check_backend_name",
           "why_triton_cannot_run"]
