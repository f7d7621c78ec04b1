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
