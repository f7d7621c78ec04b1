"""Files shared between processes: an exclusive lock, and whole-file writes readers never see half of.

The ranks of a launch, or several jobs on one machine, may build or update the same cached file at
once (the corpus, ``muonlab.data``; the backend choices, ``muonlab.kernels.backend_choice``).
"""

from __future__ import annotations

import contextlib
import os
import uuid
from pathlib import Path

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None


@contextlib.contextmanager
def file_lock(path: Path):
    """An exclusive lock on ``path``'s sidecar ``.lock`` file, between processes; none where the
    platform has no ``fcntl`` (Windows): there concurrent writers may still race."""
    if fcntl is None:
        yield
        return
    with open(path.with_name(path.name + ".lock"), "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # released when the handle closes
        yield


def write_atomic(path: Path, data: bytes) -> None:
    """``data`` to ``path`` through a temporary file of a unique name in the same folder, so a
    reader sees the old file or the whole new one, never a half-written one."""
    # unique even where there is no lock (no fcntl); not tempfile.mkstemp, whose 0600 mode would
    # hide a shared cache from other users
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp")
    try:
        with open(tmp, "xb") as handle:
            handle.write(data)
        os.replace(tmp, path)
    finally:  # a failed write's leftover (nothing once replaced)
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
