"""``backend="auto"``: per batch shape, the Newton-Schulz backend measured faster on this device.

Neither backend wins everywhere: on an H100 (torch 2.11, triton 3.6) the Triton kernels, which
compute only the upper tiles of the symmetric products, beat torch from width 4096 on, while below
it both are bound by host time per launch and the ranking depends on launch costs. So "auto" does
not guess from the device: the first time it meets a (batch, m, n, dtype, coefficients, form) key it
times both backends on that shape (one warm-up each, then the median of a few runs, CUDA events)
and keeps the faster, torch on a tie within 2%. Results are kept in memory and in a JSON file per
device and versions (``cache_dir()``), so a later process on the same machine, torch and triton
measures nothing; another GPU model or version measures again.
"""

from __future__ import annotations

import json
import os
import statistics
import threading
from dataclasses import replace
from pathlib import Path

import torch

from ..files import file_lock, write_atomic
from . import execute
from .backends import BACKENDS, FALLBACK
from .config import form_for
from .forms import FORMS
from .precision import fp32_matmul_precision

TIE = 0.02  # another backend must be more than 2% faster than torch to be picked: torch has no compile or tuning risk
REPEATS = 5

_lock = threading.Lock()
_memory: dict[Path, dict[str, str]] = {}
"""{cache file: {shape key: backend}}: a file is read at most once per process, when first needed."""


def cache_dir() -> Path:
    """``$MUONLAB_CACHE_DIR``, else ``$XDG_CACHE_HOME/muonlab``, else ``~/.cache/muonlab``. An
    empty or relative XDG_CACHE_HOME counts as unset, as the XDG Base Directory spec says
    (``export XDG_CACHE_HOME=`` otherwise put the cache in whatever directory a process ran in)."""
    if os.environ.get("MUONLAB_CACHE_DIR"):
        return Path(os.environ["MUONLAB_CACHE_DIR"])
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    return (Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache") / "muonlab"


def _versions() -> str:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    return f"torch{torch.__version__}-triton{triton_version}"


def cache_file(device: torch.device) -> Path:
    name = torch.cuda.get_device_name(device) if torch.device(device).type == "cuda" else "cpu"
    safe = "".join(ch if ch.isalnum() else "_" for ch in f"{name}-{_versions()}")
    return cache_dir() / f"ns_backend-{safe}.json"


def _key(batch_shape, dtype, cfg) -> str:
    form = FORMS[form_for(cfg, batch_shape[-2:])]
    # the form as it runs (the gram form with its restarts), its iterates' dtype by a GPU's rule
    ran = form.key(cfg, form.work_dtype(cfg, dtype, True))
    key = f"{tuple(batch_shape)}|{dtype}|{cfg.resolved_coefficients()}|{ran}"
    if dtype == torch.float32:  # TF32 or IEEE products, in torch and in the Triton kernels alike
        # Read through the helper (the legacy getter raises once torch's newer API is used), but
        # spelled with the legacy names, so choices already in cache files keep matching.
        key += "|highest" if fp32_matmul_precision() == "ieee" else "|high"
    return key


def _read(path: Path) -> dict[str, str]:
    """The choices in one cache file: {} where there is none, or a damaged one (measured again,
    then rewritten); entries other than a registered backend's name (a hand-edited file) are left out."""
    try:
        return {k: v for k, v in dict(json.loads(path.read_text())).items() if isinstance(v, str) and v in BACKENDS}
    except (OSError, ValueError, TypeError, RecursionError):  # RecursionError: deeply nested JSON
        return {}


def _choices(path: Path) -> dict[str, str]:
    """The known choices of one cache file, read from disk the first time."""
    if path not in _memory:
        _memory[path] = _read(path)
    return _memory[path]


def _store(path: Path) -> None:
    """Write this process's choices to ``path``, merged with what other processes (other jobs,
    ranks meeting other shapes) wrote since it was read: under the file lock, the file is read
    again, and rewritten whole through a temporary file (atomic: readers never see half a file)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with file_lock(path):
            merged = {**_read(path), **_memory[path]}  # ours win: just measured, in this process
            _memory[path] = merged
            write_atomic(path, json.dumps(merged, indent=1, sort_keys=True).encode())
    except OSError:
        pass  # a read-only home: keep the choice for this process only


def faster_backend(batch_shape: tuple[int, int, int], dtype: torch.dtype, cfg, device: torch.device) -> str:
    """The faster, on a normalised batch of ``batch_shape`` (B, m, n), m <= n, on CUDA, of the
    registered backends that take ``dtype`` and can run on ``device``; ``FALLBACK``, unmeasured,
    where no other does (timing Triton on fp64 would raise, or compute garbage)."""
    candidates = [name for name, record in BACKENDS.items() if record.takes(dtype) and record.usable(device)]
    if candidates == [FALLBACK]:
        return FALLBACK
    path = cache_file(device)
    key = _key(batch_shape, dtype, cfg)
    with _lock:
        choices = _choices(path)
        if key not in choices:  # another process may have measured it since the file was read
            choices = _memory[path] = {**_read(path), **choices}
        if key not in choices:
            if torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"backend='auto' has not measured Newton-Schulz on {tuple(batch_shape)} {dtype} "
                                   "yet and can't while a CUDA graph is being captured: run one eager call first")
            choices[key] = _measure(batch_shape, dtype, cfg, device, candidates)
            _store(path)
        return _memory[path][key]


def measured_choices(device: torch.device) -> dict[str, str]:
    """{shape key: backend} known for ``device`` (in memory or from its cache file)."""
    with _lock:
        return dict(_choices(cache_file(device)))


def _measure(batch_shape, dtype, cfg, device, candidates) -> str:
    """Time each of ``candidates`` (backend names, ``FALLBACK`` among them) on a (B, m, n) batch,
    each running what ``newton_schulz`` would run there: the form that runs on the shape,
    iterating in its dtype on CUDA (which multiplies fp16 natively). The fastest, if more than
    ``TIE`` faster than ``FALLBACK``; else ``FALLBACK``."""
    form = form_for(cfg, batch_shape[-2:])
    iterates = FORMS[form].work_dtype(cfg, dtype, True)
    # A generator of its own: drawing from the default one would advance the caller's RNG on the
    # first process (or rank) that meets this shape but not on those that find it cached.
    generator = torch.Generator(device=device)
    generator.manual_seed(0)
    X = torch.randn(batch_shape, dtype=dtype, device=device, generator=generator)
    times = {}
    for backend in candidates:
        fixed = replace(cfg, backend=backend, dtype=dtype)

        def once():  # as a call of newton_schulz without a workspace: output and buffers fresh
            out = torch.empty(batch_shape, dtype=dtype, device=device)
            execute.run([X], [out], fixed, form=form, backend=backend, dtype=iterates)

        once()  # compile, autotune, warm the allocator
        runs = []
        for _ in range(REPEATS):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            once()
            end.record()
            end.synchronize()
            runs.append(start.elapsed_time(end))
        times[backend] = statistics.median(runs)
    fastest = min(times, key=times.get)
    return fastest if times[fastest] < (1 - TIE) * times[FALLBACK] else FALLBACK
