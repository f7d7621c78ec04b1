"""The runner's workspace budget holds whatever backend runs a chunk and whatever dtype the inputs
come in, and the runner takes every shape ``newton_schulz`` takes.

"auto" times its backends only on CUDA; here stand-ins answer for the timing (and, under the
Triton interpreter, for the device), as ``tests/kernels/test_runner.py`` does for the cache.
"""

from __future__ import annotations

import importlib

import pytest
import torch

import muonlab
from muonlab.kernels import backend_choice
from muonlab.kernels.backends import BACKENDS
from muonlab.kernels.batch_io import Overwrite
from muonlab.kernels.config import NSConfig
from muonlab.kernels.newton_schulz import newton_schulz
from muonlab.kernels.runner import NewtonSchulzRunner, matrices_within
from muonlab.kernels.workspace import batch_bytes_per_matrix, max_batch_matrices

# the modules themselves: the package's names newton_schulz (and runner's) are its functions
ns_module = importlib.import_module("muonlab.kernels.newton_schulz")
runner_module = importlib.import_module("muonlab.kernels.runner")


def test_auto_counts_tritons_bytes_wherever_it_may_pick_triton(monkeypatch):
    """"auto" may pick Triton for any batch size below the count (chunks and plan batches are cut
    evenly, smaller than it), so wherever it can pick Triton the count is Triton's, and it is
    made without timing anything (every rank then plans the same batches). It was the torch
    path's count wherever the timing at that count said torch: 58 matrices then ran as 29 + 29
    on Triton, 1.26x the budget."""
    pytest.importorskip("triton")
    if not BACKENDS["triton"].usable(torch.device("cuda")):
        pytest.skip("triton can't run on CUDA here (not installed or failed to import)")
    from muonlab.kernels import triton_newton_schulz as tns

    # as on a GPU: under TRITON_INTERPRET=1 (tests/conftest.py) "auto" never offers Triton
    monkeypatch.setattr(tns, "INTERPRET", False)
    m, n = 8, 64
    budget = 30 * batch_bytes_per_matrix(m, n, 4)  # 30 matrices on the torch path, 22 on Triton's
    timed = []

    def faster_backend(batch_shape, dtype, cfg, device):  # Triton wins at every size but 30
        timed.append(batch_shape[0])
        return "torch" if batch_shape[0] == 30 else "triton"

    monkeypatch.setattr(backend_choice, "faster_backend", faster_backend)
    cfg = NSConfig(dtype=torch.float32, backend="auto")
    triton_count = budget // batch_bytes_per_matrix(m, n, 4, backend="triton")
    assert triton_count == 22
    assert matrices_within(budget, (m, n), torch.float32, cfg, device="cuda") == triton_count
    assert timed == []
    # off CUDA "auto" never picks Triton: the torch path's count
    assert matrices_within(budget, (m, n), torch.float32, cfg, device="cpu") == 30


def test_auto_chunks_fit_the_backend_picked_for_their_own_size(monkeypatch):
    """The runner picks each chunk's backend for the chunk's size and runs that one: a chunk
    sized for the torch path that its picker sends to Triton is cut again at Triton's count.
    Here the CPU (under the Triton interpreter) stands in for a GPU where "auto" picks torch at
    the budget's count and Triton below it."""
    pytest.importorskip("triton")
    from muonlab.kernels import triton_newton_schulz as tns

    if torch.cuda.is_available() or not tns.INTERPRET:
        pytest.skip("the stand-in takes the CPU for a GPU under TRITON_INTERPRET=1 (set by tests/conftest.py)")
    m, n, item = 8, 32, 4
    budget = 6 * batch_bytes_per_matrix(m, n, item)
    triton_count = budget // batch_bytes_per_matrix(m, n, item, backend="triton")
    assert triton_count == 4

    def pick(backend, device, batch_shape, dtype, cfg):  # pick_backend, with this CPU taken for a GPU
        if backend != "auto":
            return backend
        return "torch" if batch_shape[0] == 6 else "triton"

    monkeypatch.setattr(ns_module, "pick_backend", pick)
    monkeypatch.setattr(runner_module, "pick_backend", pick)
    on_triton = []
    real = tns.newton_schulz_triton
    monkeypatch.setattr(tns, "newton_schulz_triton",
                        lambda X, *a, **k: on_triton.append(X.shape[0]) or real(X, *a, **k))
    mats = torch.randn(10, m, n, generator=torch.Generator().manual_seed(0))
    runner = NewtonSchulzRunner(budget)
    got = runner(mats, NSConfig(steps=2, dtype=torch.float32, backend="auto"))  # 2 steps: the interpreter is slow
    assert on_triton == [4, 3, 3]  # 10 under 6 cut 5 + 5, which Triton doesn't fit: 10 under 4
    # the arena of the largest chunk, plus that chunk's input and output, within the budget
    assert runner.workspace.nbytes + 2 * max(on_triton) * m * n * item <= budget
    torch.testing.assert_close(got, newton_schulz(mats, NSConfig(steps=2, dtype=torch.float32, backend="torch")),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("input_dtype, dtype", [(torch.float32, torch.bfloat16), (torch.float64, torch.float32)])
def test_inputs_wider_than_the_compute_dtype_count_at_their_own_itemsize(input_dtype, dtype, monkeypatch):
    """``Overwrite`` pieces in a wider dtype than the compute dtype (Muon's local path hands over
    fp32 momentum to bf16 Newton-Schulz) are no iterate, and take their own bytes: counted at the
    compute dtype's itemsize, a chunk took 1.29x the budget."""
    m, n = 32, 64
    narrow, wide = dtype.itemsize, input_dtype.itemsize
    budget = 4 * batch_bytes_per_matrix(m, n, narrow)  # four matrices, were the inputs narrow
    runner, chunks = NewtonSchulzRunner(budget), []
    real = runner_module.run_resolved  # each chunk's run, its choices made
    monkeypatch.setattr(runner_module, "run_resolved",
                        lambda mats, *a: chunks.append(sum(p.shape[0] for p in mats)) or real(mats, *a))
    pieces = Overwrite([torch.randn(8, m, n, dtype=input_dtype)])
    expected = newton_schulz(pieces[0], NSConfig(dtype=dtype)).to(input_dtype)
    assert runner(pieces, NSConfig(dtype=dtype, form="plain")) is pieces and torch.equal(pieces[0], expected)
    assert runner.workspace.nbytes + max(chunks) * m * n * wide <= budget  # arena + a chunk's inputs (= outputs)
    assert chunks == [3, 3, 2]  # were 4 + 4
    assert batch_bytes_per_matrix(m, n, narrow, input_itemsize=wide) == wide * m * n + narrow * (2 * m * n + 2 * m * m)
    assert runner.chunk_size((m, n), dtype, input_dtype=input_dtype) == 3
    assert batch_bytes_per_matrix(m, n, narrow, input_itemsize=narrow) == batch_bytes_per_matrix(m, n, narrow)
    assert batch_bytes_per_matrix(m, n, narrow, reuses_input=True, input_itemsize=wide) == \
        batch_bytes_per_matrix(m, n, narrow, reuses_input=True)  # a reused input is an iterate


def test_muon_sizes_its_local_batches_by_the_momentum_dtype():
    """Muon's plan cuts a bank by the budget with its momentum, the Newton-Schulz input, counted
    at the momentum's itemsize: fp32 momentum into bf16 Newton-Schulz takes twice the bytes."""
    m, n = 16, 48
    budget = 4 * batch_bytes_per_matrix(m, n, 2)
    sizes = {}
    for momentum_dtype in (None, torch.float32):
        p = torch.nn.Parameter(torch.randn(12, m, n).bfloat16())
        opt = muonlab.Muon([p], momentum_dtype=momentum_dtype, ns_dtype=torch.bfloat16, ns_form="plain",
                           workspace_bytes=budget)
        sizes[momentum_dtype] = max(b.num_matrices for b in opt.plan())
    assert sizes == {None: 4, torch.float32: 3}  # were 4 and 4
    assert max_batch_matrices((m, n), 2, budget, input_itemsize=4) == 3


@pytest.mark.parametrize("shape", [(3, 0, 10), (3, 10, 0), (0, 6, 10), (6, 10), (2, 3, 6, 10), (2, 0, 6, 10)])
def test_the_runner_takes_every_shape_newton_schulz_takes(shape):
    """Matrices with a zero dim take no bytes (the count divided by zero) and need no work; a
    stack of any leading dims comes back in its shape (a 2-D or 4-D stack was read along its
    first dim, and refused with a misleading 'out must hold' error)."""
    cfg = NSConfig(dtype=torch.float32)
    x = torch.randn(shape)
    expected = newton_schulz(x, cfg)
    got = NewtonSchulzRunner(2**20)(x, cfg)
    assert got.shape == expected.shape and torch.equal(got, expected)
    pieces = Overwrite([x.clone()])
    assert NewtonSchulzRunner(2**20)(pieces, cfg) is pieces and torch.equal(pieces[0], expected)
    rows, cols = shape[-2:]
    assert matrices_within(2**20, (rows, cols), torch.float32) >= 1


def test_the_runner_names_a_stack_that_holds_no_matrix():
    with pytest.raises(ValueError, match=r"at least 2 dims, got shape \(5,\)"):
        NewtonSchulzRunner(2**20)(torch.randn(5), NSConfig(dtype=torch.float32))
