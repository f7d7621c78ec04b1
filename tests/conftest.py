"""Session-wide test settings.

Without CUDA, Triton kernels can only run under its interpreter, which must be chosen before the
kernel module is imported; setting it here, first, keeps every test module's import order safe.
muonlab never picks the interpreter by itself (backend="auto" needs CUDA for Triton).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
