"""Session-wide test settings.

Without CUDA, Triton kernels can only run under its interpreter, which must be chosen before the
kernel module is imported; setting it here, first, keeps every test module's import order safe.
muonlab never picks the interpreter by itself (backend="auto" needs CUDA for Triton).
"""

import contextlib
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def cuda_sync_errors():
    """A context manager under which any CUDA call that waits for the GPU raises
    (``torch.cuda.set_sync_debug_mode("error")``), with the device idle before and after."""

    @contextlib.contextmanager
    def errors():
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()

    return errors


def pytest_terminal_summary(terminalreporter):
    """Say why the browser tests did not run (a missing Chromium): among the suite's other skips
    (no GPU, no Triton, ...) a quiet run would not show it, and `make test` would look complete."""
    skipped = [r for r in terminalreporter.stats.get("skipped", []) if r.nodeid.startswith("tests/browser/")]
    if not skipped:
        return
    reasons = sorted({r.longrepr[2].removeprefix("Skipped: ") for r in skipped if isinstance(r.longrepr, tuple)})
    terminalreporter.write_sep("-", "browser tests not run")
    terminalreporter.write_line(f"{len(skipped)} test(s) in tests/browser skipped: {'; '.join(reasons)}")
