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

# triton 3.6.0's interpreter turns a runtime loop bound (``range(0, K, BLOCK_K)``) into a Python
# int with int() on a 1-element numpy array, which numpy >= 2.4 refuses ("only 0-dimensional
# arrays can be converted to Python scalars"); triton 3.9's interpreter squeezes first. An
# interpreter limitation, not a kernel bug: compiled kernels never take that path.
INTERPRETER_INDEX_BUG = "only 0-dimensional arrays can be converted to Python scalars"


def _interpreter_broken():
    """The reason the interpreter cannot run these kernels here, or None."""
    try:
        sym_matmul(torch.ones(1, 2, 4))
    except Exception as err:  # noqa: BLE001 - only the known failure is turned into a skip
        if INTERPRETER_INDEX_BUG in str(err):
            import numpy
            import triton

            return (
                f"triton {triton.__version__}'s interpreter cannot run a loop with a runtime bound under numpy "
                f"{numpy.__version__} ({INTERPRETER_INDEX_BUG}); triton 3.9's interpreter can, and compiled "
                "kernels are unaffected"
            )
        raise
    return None


if tns.INTERPRET:
    _reason = _interpreter_broken()
    if _reason:
        pytest.skip(_reason, allow_module_level=True)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (compiled Triton)")

from muonlab.kernels.coefficients import PRESETS, resolve_coefficients  # noqa: E402
from muonlab.kernels.forms.plain import plain_flops_per_iter, symmetric_flops_per_iter  # noqa: E402
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
    try:
        sym_matmul(torch.ones(1, 2, 4))
    except Exception as err:
        if "only 0-dimensional arrays can be converted to Python scalars" not in str(err):
            raise
        import numpy, triton
        print(f"SKIP: triton {triton.__version__}'s interpreter cannot run a loop with a runtime bound "
              f"under numpy {numpy.__version__} ({err}); the compiled check is test_offsets_are_64_bit_compiled_gpu")
        raise SystemExit(0)
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
    rel_torch = ((plain_iterations(X, coefficients).double() - ref).norm() / ref.norm()).item()  # torch bf16
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


# ------------------------------------------------------------------- workspace and launch cache


def _normalised(batch, m, n, transposed, dtype, seed=0):
    X = _input(batch, m, n, transposed, dtype=torch.float32, seed=seed)
    return (X / X.norm(dim=(-2, -1), keepdim=True)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("batch,m,n,transposed,steps", [(1, 127, 300, False, 3), (2, 65, 130, True, 2)])
def test_workspace_is_bit_identical(dtype, batch, m, n, transposed, steps):
    X = _normalised(batch, m, n, transposed, dtype)
    coefficients = COEFFICIENTS["polar_express"][:steps]
    plain = newton_schulz_triton(X, coefficients)
    ws = tns.NSWorkspace.like(X)
    for buf in (ws.gram, ws.poly, ws.ping, ws.pong):
        buf.fill_(float("nan"))  # nothing may be read before it is written
    Y = newton_schulz_triton(X, coefficients, workspace=ws)
    assert Y is (ws.ping if steps % 2 else ws.pong)  # the documented contract: the last buffer written
    assert torch.equal(Y, plain)
    # a dict of the same buffers, reused: same bits again
    again = newton_schulz_triton(X, coefficients, workspace=dict(gram=ws.gram, poly=ws.poly, ping=ws.ping, pong=ws.pong))
    assert torch.equal(again, plain)
    # pong may be X itself (contiguous; only the first iteration reads it): same bits, one buffer less
    own = X.clone(memory_format=torch.contiguous_format)
    mine = newton_schulz_triton(own, coefficients, workspace=tns.NSWorkspace(ws.gram, ws.poly, ws.ping, pong=own))
    assert torch.equal(mine, plain)


def test_workspace_without_coefficients_copies_into_ping():
    X = _normalised(1, 4, 8, True, torch.float32)
    ws = tns.NSWorkspace.like(X)
    Y = newton_schulz_triton(X, [], workspace=ws)
    assert Y is ws.ping and torch.equal(Y, X)


def test_workspace_errors_name_the_buffer():
    X = _normalised(2, 8, 16, False, torch.float32)
    good = tns.NSWorkspace.like(X)
    keller = COEFFICIENTS["keller"][:1]

    def with_(**change):
        fields = dict(gram=good.gram, poly=good.poly, ping=good.ping, pong=good.pong)
        fields.update(change)
        return tns.NSWorkspace(**fields)

    cases = [
        (with_(gram=torch.empty(2, 8, 9, device=X.device)), r"workspace\.gram of shape \(2, 8, 9\).*expected shape \(2, 8, 8\)"),
        (with_(ping=torch.empty(2, 8, 16, dtype=torch.float16, device=X.device)), r"workspace\.ping .*float16.*expected X's dtype"),
        (with_(pong=torch.empty(2, 8, 16, device="meta")), r"workspace\.pong .*meta.*expected X's device"),
        (with_(poly=torch.empty(2, 8, 8, device=X.device).mT), r"workspace\.poly .*must be contiguous"),
        (with_(ping=good.pong), r"workspace\.pong .*overlaps workspace\.ping"),
        (with_(ping=X), r"workspace\.ping .*overlaps X"),
    ]
    for workspace, pattern in cases:
        with pytest.raises(ValueError, match=pattern):
            newton_schulz_triton(X, keller, workspace=workspace)
    with pytest.raises(ValueError, match=r"missing \['pong'\]"):
        newton_schulz_triton(X, keller, workspace=dict(gram=good.gram, poly=good.poly, ping=good.ping))
    with pytest.raises(TypeError, match="NSWorkspace"):
        newton_schulz_triton(X, keller, workspace=[good.gram])
    with pytest.raises(TypeError, match=r"workspace\.gram must be a torch\.Tensor"):
        newton_schulz_triton(X, keller, workspace=with_(gram=None))


def _count_autotuner_runs(monkeypatch):
    calls = {"sym_matmul_kernel": 0, "matmul_kernel": 0}
    for name in calls:
        kernel = getattr(tns, name)
        original = kernel.run

        def counted(*args, _name=name, _original=original, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(kernel, "run", counted)  # Autotuner[grid] calls self.run
    return calls


def test_launch_cache_reused_on_second_call(monkeypatch):
    tns.clear_launch_cache()
    calls = _count_autotuner_runs(monkeypatch)
    X = _normalised(1, 127, 300, False, torch.float32)
    coefficients = COEFFICIENTS["keller"][:2]
    first = newton_schulz_triton(X, coefficients)
    info = tns.launch_cache_info()
    # X X^T, A A, and P X into ping: the second iteration's P ping into pong has the same layout
    assert info["entries"] == 3 and info["misses"] == 3 and info["hits"] == 3, info
    assert calls == {"sym_matmul_kernel": 2, "matmul_kernel": 1}
    second = newton_schulz_triton(X, coefficients)
    info = tns.launch_cache_info()
    assert info["entries"] == 3 and info["misses"] == 3 and info["hits"] == 9, info
    assert calls == {"sym_matmul_kernel": 2, "matmul_kernel": 1}, "the second call went through the autotuner"
    assert torch.equal(first, second)


def test_launch_cache_key_separates_layouts():
    # A view that starts 4 bytes into its storage is not 16-byte aligned: triton compiles another
    # specialization for it, so it must not reuse the aligned entry.
    tns.clear_launch_cache()
    base = _input(1, 64, 129, False)
    aligned = base[:, :, :128]
    shifted = base[:, :, 1:]
    out = _poisoned((1, 64, 64), torch.float32)
    sym_matmul(aligned, out=out)
    assert tns.launch_cache_info()["entries"] == 1
    sym_matmul(shifted, out=out)
    assert tns.launch_cache_info()["entries"] == 2
    _assert_written_and_close(out, shifted.double() @ shifted.double().mT, torch.float32)
    sym_matmul(base.clone()[:, :, :128], out=out)  # another tensor of the same layout: the same entry
    assert tns.launch_cache_info()["entries"] == 2


def test_launch_modes_are_bit_identical():
    # Under the interpreter "direct" has no compiled kernel and takes the JIT path; "autotune"
    # skips the cache. On a GPU the same test runs compiled (see the GPU-only parity test too).
    X = _normalised(2, 65, 130, True, torch.float32)
    coefficients = COEFFICIENTS["keller"][:2]
    results = {}
    for mode in tns.LAUNCH_MODES:
        with tns.launch_mode(mode):
            results[mode] = newton_schulz_triton(X, coefficients)
    assert torch.equal(results["direct"], results["autotune"]) and torch.equal(results["jit"], results["autotune"])
    with pytest.raises(ValueError, match="launch mode"):
        tns.launch_mode("fast")


def test_direct_launch_fallback_choice():
    # Without the CompiledKernel API (None under the interpreter, or an object from another
    # triton) the cache must choose the JIT launch, never a guessed call.
    assert tns._direct_launcher(None, (1, 1), ()) is None
    assert tns._direct_launcher(object(), (1, 1), ()) is None
    ref = torch.arange(12, dtype=torch.float32).reshape(1, 3, 4).mT  # strided, like a real output
    assert tns._direct_matches(ref, lambda buf: buf.copy_(ref))
    assert not tns._direct_matches(ref, lambda buf: buf.copy_(ref + 1))
    nan_ref = torch.full((2, 2), float("nan"), dtype=torch.bfloat16)
    assert tns._direct_matches(nan_ref, lambda buf: buf.copy_(nan_ref))  # bits, not ==, so NaN == NaN

    def broken(buf):
        raise IndexError("tuple index out of range")

    with pytest.warns(UserWarning, match="IndexError"):
        assert not tns._direct_matches(ref, broken)


# ------------------------------------------------------------------------ GPU only: fast launches


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("batch,m,n,transposed", [(1, 768, 3072, False), (3, 300, 700, True)])
def test_direct_launch_matches_autotuned_launch_gpu(dtype, batch, m, n, transposed):
    tns.clear_launch_cache()
    X = _normalised(batch, m, n, transposed, dtype)
    coefficients = COEFFICIENTS["polar_express"]
    with tns.launch_mode("autotune"):
        ref = newton_schulz_triton(X, coefficients)
        ref_sym = sym_matmul(X)
        ref_mm = batched_matmul_add(ref_sym, X, X, alpha=0.5, beta=-1.5)
    with tns.launch_mode("direct"):
        for _ in range(2):  # the first call resolves and verifies, the second is a pure cache hit
            Y = newton_schulz_triton(X, coefficients)
            G = sym_matmul(X)
            Z = batched_matmul_add(G, X, X, alpha=0.5, beta=-1.5)
            torch.testing.assert_close(Y, ref, rtol=0, atol=0)
            torch.testing.assert_close(G, ref_sym, rtol=0, atol=0)
            torch.testing.assert_close(Z, ref_mm, rtol=0, atol=0)
    info = tns.launch_cache_info()
    import triton

    assert info["direct_api_ok"] == {"sym_matmul_kernel": True, "matmul_kernel": True}, (
        f"triton {triton.__version__}: the direct launch was not verified, every launch takes the slow JIT path: {info}"
    )
    assert all(entry["direct"] for entry in info["launches"]), info


@needs_gpu
def test_workspace_chain_replays_in_cuda_graph_gpu():
    X = _normalised(2, 512, 1408, False, torch.bfloat16)
    coefficients = COEFFICIENTS["keller"]
    ws = tns.NSWorkspace.like(X)
    static_x = X.clone()
    eager = newton_schulz_triton(static_x, coefficients, workspace=ws).clone()  # warm-up resolves the launches
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        newton_schulz_triton(static_x, coefficients, workspace=ws)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = newton_schulz_triton(static_x, coefficients, workspace=ws)
    ws.ping.zero_()
    ws.pong.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    other = _normalised(2, 512, 1408, False, torch.bfloat16, seed=7)
    static_x.copy_(other)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, newton_schulz_triton(other, coefficients))


@needs_gpu
def test_offsets_are_64_bit_compiled_gpu():
    # bf16 batches 2**30 elements apart: batch 2 starts at element 2**31 (byte 2**32), so a 32-bit
    # element offset wraps there. Two such strided tensors need about 8 GiB of GPU memory; only
    # the slices the kernels touch are filled and compared.
    need = 2 * (2 * 2**30 + 2**20) * 2
    free, _ = torch.cuda.mem_get_info()
    if free < need + 2**30:
        pytest.skip(f"needs about {need / 2**30:.1f} GiB of free GPU memory, {free / 2**30:.1f} GiB free")
    m, k, n = 96, 160, 72  # partial tiles in every dimension
    stride = 2**30
    g = torch.Generator().manual_seed(0)
    base = torch.empty(2 * stride + m * k, device="cuda", dtype=torch.bfloat16)
    out_base = torch.empty(2 * stride + m * k, device="cuda", dtype=torch.bfloat16)
    try:
        X = base.as_strided((3, m, k), (stride, k, 1))
        src = (torch.randn(3, m, k, generator=g) / k**0.5).to("cuda", torch.bfloat16)
        X.copy_(src)
        ref = src.float() @ src.float().mT

        out = out_base.as_strided((3, m, m), (stride, m, 1))
        out.fill_(float("nan"))
        sym_matmul(X, out=out)
        assert not torch.isnan(out).any(), "sym_matmul left elements past 2**31 unwritten"
        torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)

        # P with the huge batch stride, output too
        Q = (torch.randn(3, k, n, generator=g) / k**0.5).to("cuda", torch.bfloat16)
        prod = out_base.as_strided((3, m, n), (stride, n, 1))
        prod.fill_(float("nan"))
        batched_matmul_add(X, Q, out=prod)
        torch.testing.assert_close(prod.float(), src.float() @ Q.float(), rtol=2e-2, atol=2e-2)

        # Q (and the residual) with the huge batch stride: X^T as a (B, k, m) view
        P = (torch.randn(3, n, k, generator=g) / k**0.5).to("cuda", torch.bfloat16)
        R = out_base.as_strided((3, n, m), (stride, m, 1))
        R.copy_(torch.randn(3, n, m, generator=g).to("cuda", torch.bfloat16))
        got = batched_matmul_add(P, X.mT, R, alpha=1.0, beta=0.5)
        torch.testing.assert_close(got.float(), P.float() @ src.float().mT + 0.5 * R.float(), rtol=2e-2, atol=2e-2)
    finally:
        del base, out_base
        torch.cuda.empty_cache()
