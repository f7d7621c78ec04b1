"""Triton Newton-Schulz kernels against torch, on odd shapes, under the interpreter on CPU.

Every output buffer is prefilled with NaN, so an element no program writes is caught. Shapes are
small and the interpreter's tiles large (see INTERPRET_BLOCK_*): the whole file runs in well under
a minute on 2 CPU cores.
"""

import os

import torch

if not torch.cuda.is_available():
    # Must precede the import of the module that defines the kernels.
    os.environ["TRITON_INTERPRET"] = "1"

import importlib  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

pytest.importorskip("triton")

import muonlab.kernels.triton_newton_schulz as tns  # noqa: E402

if not torch.cuda.is_available() and not tns.INTERPRET:
    # Imported earlier in this process without the interpreter (another test module): define the
    # kernels again, now interpreted.
    tns = importlib.reload(tns)

from muonlab.kernels.triton_newton_schulz import (  # noqa: E402,F401  (public names exist)
    TRITON_AVAILABLE,
    batched_matmul_add,
    newton_schulz_triton,
    sym_matmul,
)

REPO = Path(__file__).resolve().parents[2]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (compiled Triton)")

from muonlab.kernels.newton_schulz import (  # noqa: E402
    PRESETS,
    plain_flops_per_iter,
    resolve_coefficients,
    symmetric_flops_per_iter,
)
from muonlab.kernels.reference import plain_iterations  # noqa: E402

COEFFICIENTS = {name: resolve_coefficients(name, 5) for name in PRESETS}

# (batch, m, n, transposed): transposed=True builds a (batch, n, m) tensor and passes its .mT view.
SHAPES = [
    (1, 127, 300, False),
    (1, 1, 64, False),
    (3, 127, 300, True),
    (1, 128, 128, False),
]
TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.float16: dict(rtol=2e-3, atol=2e-3)}


def _input(batch, m, n, transposed, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    if transposed:
        x = torch.randn(batch, n, m, generator=g).mT
        assert not x.is_contiguous() or min(m, n) == 1
    else:
        x = torch.randn(batch, m, n, generator=g)
    # Entries of X X^T stay O(1), so one tolerance fits every shape.
    return (x / n**0.5).to(device=DEVICE, dtype=dtype)


def _poisoned(shape, dtype):
    return torch.full(shape, float("nan"), device=DEVICE, dtype=dtype)


def _assert_written_and_close(out, ref, dtype):
    assert not torch.isnan(out).any(), "some output elements were never written"
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])


def _reference_ns(X, coefficients):
    return plain_iterations(X.double(), coefficients)


# ------------------------------------------------------------------------------------ sym_matmul


@pytest.mark.parametrize("batch,m,k,transposed", SHAPES)
def test_sym_matmul_fp32(batch, m, k, transposed):
    X = _input(batch, m, k, transposed)
    out = _poisoned((batch, m, m), torch.float32)
    res = sym_matmul(X, out=out)
    assert res is out
    _assert_written_and_close(out, X.double() @ X.double().mT, torch.float32)


@pytest.mark.parametrize("batch,m,k,transposed", [(1, 127, 300, False), (3, 127, 300, True)])
def test_sym_matmul_fp16(batch, m, k, transposed):
    X = _input(batch, m, k, transposed, dtype=torch.float16)
    out = _poisoned((batch, m, m), torch.float16)
    sym_matmul(X, out=out)
    _assert_written_and_close(out, X.double() @ X.double().mT, torch.float16)


def test_sym_matmul_fp32_output_for_fp16_input():
    X = _input(1, 127, 300, False, dtype=torch.float16)
    out = _poisoned((1, 127, 127), torch.float32)
    sym_matmul(X, out=out, out_dtype=torch.float32)
    _assert_written_and_close(out, X.double() @ X.double().mT, torch.float32)
    assert sym_matmul(X, out_dtype=torch.float32).dtype == torch.float32


@pytest.mark.parametrize("batch,m,k,transposed", [(1, 127, 300, False), (3, 127, 127, True), (1, 1, 64, False)])
def test_sym_matmul_epilogue(batch, m, k, transposed):
    # C is neither symmetric nor contiguous: the mirrored tiles must read C at their own place.
    X = _input(batch, m, k, transposed)
    C = _input(batch, m, m, True, seed=1)
    out = _poisoned((batch, m, m), torch.float32)
    sym_matmul(X, out=out, C=C, alpha=-0.7, beta=2.5)
    ref = -0.7 * (X.double() @ X.double().mT) + 2.5 * C.double()
    _assert_written_and_close(out, ref, torch.float32)


def test_sym_matmul_square_of_symmetric():
    # The Newton-Schulz use: b*A + c*A@A from A alone (A @ A == A @ A^T for symmetric A).
    X = _input(3, 127, 300, False)
    A = X @ X.mT
    A = (A + A.mT) / 2
    out = _poisoned(A.shape, torch.float32)
    sym_matmul(A, out=out, C=A, alpha=2.0315, beta=-4.7750)
    ref = -4.7750 * A.double() + 2.0315 * (A.double() @ A.double())
    _assert_written_and_close(out, ref, torch.float32)


# ------------------------------------------------------------------------------ batched_matmul_add


@pytest.mark.parametrize("batch,m,n,transposed", SHAPES)
def test_batched_matmul_add_fp32(batch, m, n, transposed):
    # The Newton-Schulz use: P (m x m) @ X (m x n) + beta * X, X possibly a transposed view.
    X = _input(batch, m, n, transposed)
    P = _input(batch, m, m, False, seed=2)
    out = _poisoned((batch, m, n), torch.float32)
    res = batched_matmul_add(P, X, X, alpha=1.5, beta=3.4445, out=out)
    assert res is out
    ref = 1.5 * (P.double() @ X.double()) + 3.4445 * X.double()
    _assert_written_and_close(out, ref, torch.float32)


def test_batched_matmul_add_rectangular_no_residual():
    P = _input(3, 100, 300, True, seed=3)
    Q = _input(3, 300, 70, False, seed=4)
    out = _poisoned((3, 100, 70), torch.float32)
    batched_matmul_add(P, Q, out=out, alpha=0.5)
    _assert_written_and_close(out, 0.5 * (P.double() @ Q.double()), torch.float32)


def test_batched_matmul_add_fp16():
    X = _input(3, 127, 300, True, dtype=torch.float16)
    P = _input(3, 127, 127, False, dtype=torch.float16, seed=5)
    out = _poisoned((3, 127, 300), torch.float16)
    batched_matmul_add(P, X, X, alpha=1.0, beta=2.0, out=out)
    _assert_written_and_close(out, P.double() @ X.double() + 2.0 * X.double(), torch.float16)


# ----------------------------------------------------------------------------- newton_schulz_triton


@pytest.mark.parametrize("name", sorted(COEFFICIENTS))
@pytest.mark.parametrize("batch,m,n,transposed", [(1, 127, 300, False)])
def test_newton_schulz_triton_matches_torch_fp32(name, batch, m, n, transposed):
    X = _input(batch, m, n, transposed)
    X = X / X.norm(dim=(-2, -1), keepdim=True)
    coefficients = COEFFICIENTS[name]
    Y = newton_schulz_triton(X, coefficients)
    assert Y.shape == X.shape and Y.dtype == X.dtype
    torch.testing.assert_close(Y.double(), _reference_ns(X, coefficients), rtol=1e-4, atol=1e-5)


def test_newton_schulz_triton_batched_noncontiguous():
    X = _input(3, 127, 300, True)
    X = X / X.norm(dim=(-2, -1), keepdim=True)
    coefficients = COEFFICIENTS["polar_express"][:2]  # two iterations: the ping-pong buffers both used
    Y = newton_schulz_triton(X, coefficients)
    torch.testing.assert_close(Y.double(), _reference_ns(X, coefficients), rtol=1e-4, atol=1e-5)
    assert X.shape == (3, 127, 300) and not X.is_contiguous()  # input untouched as a view


def test_newton_schulz_triton_fp16_and_single_row():
    X = _input(1, 127, 300, False, dtype=torch.float16)
    X = X / X.float().norm(dim=(-2, -1), keepdim=True).half()
    Y = newton_schulz_triton(X, COEFFICIENTS["keller"][:3])
    assert Y.dtype == torch.float16
    ref = _reference_ns(X, COEFFICIENTS["keller"][:3])
    assert (Y.double() - ref).abs().max() < 2e-2  # fp16 intermediates vs fp64
    row = _input(1, 1, 64, False)
    row = row / row.norm()
    torch.testing.assert_close(
        newton_schulz_triton(row, COEFFICIENTS["polar_express"]).double(),
        _reference_ns(row, COEFFICIENTS["polar_express"]),
        rtol=1e-4,
        atol=1e-5,
    )


def test_newton_schulz_triton_no_coefficients_copies():
    X = _input(1, 4, 8, False)
    Y = newton_schulz_triton(X, [])
    assert torch.equal(Y, X) and Y.data_ptr() != X.data_ptr()


# ---------------------------------------------------------------------------------- input checks


def test_launchers_reject_bad_inputs():
    X = _input(1, 8, 16, False)
    with pytest.raises(ValueError, match=r"\(8, 16\)"):
        sym_matmul(X[0])
    with pytest.raises(ValueError, match=r"m <= n.*\(1, 16, 8\)"):
        newton_schulz_triton(X.mT, COEFFICIENTS["keller"])
    with pytest.raises(ValueError, match="int32"):
        sym_matmul(X.to(torch.int32))
    with pytest.raises(ValueError, match="out must have shape"):
        sym_matmul(X, out=_poisoned((1, 8, 9), torch.float32))
    with pytest.raises(ValueError, match="shares memory"):
        sym_matmul(X, out=X[:, :, :8])
    with pytest.raises(ValueError, match="does not match P"):
        batched_matmul_add(X, X)
    with pytest.raises(ValueError, match="float16"):
        batched_matmul_add(X, X.mT.half())
    with pytest.raises(ValueError, match="triple"):
        newton_schulz_triton(X, [(1.0, 2.0)])


def test_launchers_reject_cpu_tensors_without_interpreter():
    if tns.INTERPRET:
        pytest.skip("CPU tensors are valid under the interpreter")
    with pytest.raises(ValueError, match="CUDA"):
        sym_matmul(torch.randn(1, 8, 16))


# -------------------------------------------------------------------------------- 64-bit offsets

_OFFSETS_SCRIPT = textwrap.dedent(
    """
    import os
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from muonlab.kernels.triton_newton_schulz import sym_matmul, batched_matmul_add
    m, k = 8, 16
    stride = 2**30  # fits int32, but batch 2 starts at element 2**31
    try:
        base = torch.empty(2 * stride + m * k, dtype=torch.float16)  # 4 GiB reserved, pages untouched
        out_base = torch.empty(2 * stride + m * m, dtype=torch.float16)
    except RuntimeError:
        print("SKIP: cannot reserve 4 GiB of address space")
        raise SystemExit(0)
    X = base.as_strided((3, m, k), (stride, k, 1))
    src = (torch.randn(3, m, k) / 4).half()
    X.copy_(src)
    out = out_base.as_strided((3, m, m), (stride, m, 1))
    sym_matmul(X, out=out)
    ref = src.float() @ src.float().mT
    assert (out.float() - ref).abs().max() < 1e-2, "sym_matmul wrong past 2**31 elements"
    Q = (torch.randn(3, k, 5) / 4).half()
    prod = batched_matmul_add(X, Q)
    assert (prod.float() - src.float() @ Q.float()).abs().max() < 1e-2, "matmul wrong past 2**31"
    print("OK")
    """
)


def test_offsets_are_64_bit():
    # With 32-bit offsets batch 2 wraps to a negative offset: a crash or garbage, hence a subprocess.
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, "-c", _OFFSETS_SCRIPT], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    if proc.stdout.startswith("SKIP"):
        pytest.skip(proc.stdout.strip())
    assert proc.returncode == 0 and "OK" in proc.stdout, f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr[-2000:]}"


# ------------------------------------------------------------------------------- import guard


_NO_TRITON_SCRIPT = textwrap.dedent(
    """
    import importlib.abc, sys

    class BlockTriton(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "triton" or name.startswith("triton."):
                raise ImportError("triton hidden for this test")
            return None

    sys.meta_path.insert(0, BlockTriton())
    import muonlab.kernels.triton_newton_schulz as m
    assert m.TRITON_AVAILABLE is False
    assert "triton" not in sys.modules
    try:
        import torch
        m.sym_matmul(torch.zeros(1, 2, 2))
    except RuntimeError as err:
        assert "triton is not installed" in str(err)
    else:
        raise AssertionError("sym_matmul ran without triton")
    print("OK")
    """
)


def test_module_imports_without_triton():
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run(
        [sys.executable, "-c", _NO_TRITON_SCRIPT], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and "OK" in proc.stdout, f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr[-2000:]}"


# ------------------------------------------------------------------------------------ FLOP counts


@pytest.mark.parametrize("m,n", [(1, 1), (1, 64), (127, 300), (512, 512), (1024, 4096), (4096, 4096)])
def test_flops_symmetric_saving(m, n):
    plain = 4 * m * m * n + 2 * m**3
    assert plain_flops_per_iter(m, n) == plain
    sym = symmetric_flops_per_iter(m, n)
    assert sym == 3 * m * m * n + m**3
    # the tile-level count, from its own formula: at tile size 1 the symmetric products also do
    # their diagonal, m (n + m) FLOPs that the analytic count leaves out
    assert symmetric_flops_per_iter(m, n, block=1) == sym + m * (n + m)
    if m == n:
        assert sym / plain == pytest.approx(2 / 3, abs=0.005)


def test_flops_block_granularity():
    # At tile granularity the diagonal tiles and the padding cost extra, approaching the analytic
    # count as the matrix grows relative to the tile.
    assert symmetric_flops_per_iter(4096, 4096) == 4 * 4096**3  # 3 m^2 n + m^3, square
    blocked = symmetric_flops_per_iter(4096, 4096, block=128)
    assert symmetric_flops_per_iter(4096, 4096) < blocked < 1.05 * symmetric_flops_per_iter(4096, 4096)
    assert symmetric_flops_per_iter(100, 100, block=128) == 2 * 128**3 * 3
    with pytest.raises(ValueError, match="m <= n"):
        symmetric_flops_per_iter(5, 4)


# -------------------------------------------------------------------------------------- GPU only


@needs_gpu
@pytest.mark.parametrize("name", sorted(COEFFICIENTS))
def test_newton_schulz_triton_bf16_gpu(name):
    # bf16 rounding of the intermediates dominates; the Triton path must be no worse than the
    # torch bf16 loop (fp32 accumulation, bf16 outputs) against the float64 reference.
    torch.manual_seed(0)
    X = torch.randn(4, 1024, 3000, device="cuda")
    X = (X / X.norm(dim=(-2, -1), keepdim=True)).bfloat16()
    coefficients = COEFFICIENTS[name]
    Y = newton_schulz_triton(X, coefficients)
    assert Y.dtype == torch.bfloat16 and not torch.isnan(Y).any()
    ref = _reference_ns(X, coefficients)
    rel_triton = ((Y.double() - ref).norm() / ref.norm()).item()
    rel_torch = ((tns.newton_schulz_reference(X, coefficients).double() - ref).norm() / ref.norm()).item()
    assert rel_triton < 2 * rel_torch + 1e-2, f"triton {rel_triton:.3g} vs torch bf16 {rel_torch:.3g}"


@needs_gpu
@pytest.mark.parametrize("m,k", [(1024, 1024), (2048, 8192), (777, 1234)])
def test_autotuned_kernels_gpu(m, k):
    X = torch.randn(2, m, k, device="cuda", dtype=torch.bfloat16) / k**0.5
    out = torch.full((2, m, m), float("nan"), device="cuda", dtype=torch.bfloat16)
    sym_matmul(X, out=out)
    assert tns.sym_matmul_kernel.best_config is not None
    ref = X.float() @ X.float().mT
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
    Y = batched_matmul_add(out, X, X, alpha=1.0, beta=2.0)
    assert tns.matmul_kernel.best_config is not None
    torch.testing.assert_close(Y.float(), out.float() @ X.float() + 2 * X.float(), rtol=3e-2, atol=3e-2)
