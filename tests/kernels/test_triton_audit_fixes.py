"""How the Triton Newton-Schulz path is reached and checked: dispatch (backend names, dtypes, the
interpreter), launcher checks (out, out_dtype, aliasing, coefficients), the fp32 precision setting
and the "auto" timing cache. Kernel launches are tiny (under the interpreter on a CPU)."""

import os

import torch

if not torch.cuda.is_available():
    # Must precede the import of the module that defines the kernels (tests/conftest.py sets it too).
    os.environ["TRITON_INTERPRET"] = "1"

import importlib  # noqa: E402
from dataclasses import replace  # noqa: E402
import time  # noqa: E402

import pytest  # noqa: E402

pytest.importorskip("triton")

import muonlab.kernels.triton_newton_schulz as tns  # noqa: E402
from muonlab.kernels import backend_choice  # noqa: E402
from muonlab.kernels.backends import BACKENDS, backend_choices  # noqa: E402
from muonlab.kernels.coefficients import resolve_coefficients  # noqa: E402
from muonlab.kernels.config import NSConfig  # noqa: E402
from muonlab.kernels.newton_schulz import newton_schulz, pick_backend, possible_backends  # noqa: E402
from muonlab.kernels.precision import fp32_matmul_precision  # noqa: E402

if not torch.cuda.is_available() and not tns.INTERPRET:
    # Imported earlier in this process without the interpreter (another test module): define the
    # kernels again, now interpreted.
    tns = importlib.reload(tns)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KELLER = resolve_coefficients("keller", 2)


def _x(*shape, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) / shape[-1] ** 0.5).to(device=DEVICE, dtype=dtype)


class _HostEvent:
    """torch.cuda.Event stand-in timing with the host clock, so "auto" measures on this CPU."""

    def __init__(self, enable_timing=False):
        self.t = None

    def record(self, stream=None):
        self.t = time.perf_counter()

    def synchronize(self):
        pass

    def elapsed_time(self, end):
        return (end.t - self.t) * 1e3


@pytest.fixture
def restore_fp32_precision():
    matmul = torch.backends.cuda.matmul
    saved = (matmul.fp32_precision, torch.backends.fp32_precision)
    yield
    matmul.fp32_precision, torch.backends.fp32_precision = saved


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MUONLAB_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(backend_choice, "_memory", {})
    return tmp_path


# ------------------------------------------------------------------------ fp32 precision (r0)


@pytest.mark.skipif(not hasattr(torch.backends.cuda.matmul, "fp32_precision"), reason="torch without the new API")
def test_triton_path_runs_after_the_new_fp32_precision_api(restore_fp32_precision):
    """torch.get_float32_matmul_precision() raises once the new API is used: every Triton launch
    and the "auto" fp32 key read the setting, so both crashed."""
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    assert tns._dot_flags(torch.float32) == (False, "tf32")
    assert backend_choice._key((1, 8, 24), torch.float32, NSConfig()).endswith("|high")
    X = _x(1, 8, 16, dtype=torch.float16)
    torch.testing.assert_close(tns.sym_matmul(X).float(), X.float() @ X.float().mT, rtol=2e-3, atol=2e-3)
    assert fp32_matmul_precision() == "tf32"
    torch.backends.cuda.matmul.fp32_precision = "ieee"
    assert tns._dot_flags(torch.float32) == (False, "ieee")
    torch.backends.cuda.matmul.fp32_precision = "none"  # defers to the generic setting
    torch.backends.fp32_precision = "tf32"
    assert fp32_matmul_precision() == "tf32"


def test_fp32_precision_falls_back_to_the_legacy_getter(monkeypatch):
    """A torch without the per-backend attribute (or with it at "none") answers through the legacy
    getter, and a legacy getter that raises counts as torch's default, never as a crash."""
    monkeypatch.setattr(torch.backends.cuda, "matmul", object())  # no fp32_precision attribute
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high")
    assert fp32_matmul_precision() == "tf32"
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "highest")
    assert fp32_matmul_precision() == "ieee"

    def mixed():
        raise RuntimeError("mix of the legacy and new APIs")

    monkeypatch.setattr(torch, "get_float32_matmul_precision", mixed)
    assert tns._dot_flags(torch.float16) == (False, "ieee")  # read on every launch, whatever the dtype
    assert backend_choice._key((1, 8, 24), torch.float32, NSConfig()).endswith("|highest")
    assert fp32_matmul_precision() == "ieee"


# ------------------------------------------------------------------- dtypes Triton can't take (r1, r2)


@pytest.mark.parametrize("form", ["plain", "gram"])
def test_triton_backend_refuses_fp64_up_front(form):
    """fp64 reached the kernels: the gram form computed garbage, the plain form failed naming an
    internal buffer "X"."""
    with pytest.raises(ValueError, match="ns_dtype.*backend='triton'"):
        NSConfig(backend="triton", dtype=torch.float64, form=form)
    G = _x(8, 24, dtype=torch.float64)
    # dtype=None computes in G's dtype: known only once G is seen, refused there
    with pytest.raises(ValueError, match="ns_dtype.*backend='triton'"):
        newton_schulz(G, backend="triton", dtype=None, form=form)
    with pytest.raises(ValueError, match="float64"):
        tns.gram_form_products(torch.float64)


def test_auto_offers_triton_only_for_its_dtypes(monkeypatch):
    """"auto" timed Triton on fp64 (and crashed): possible_backends now takes the dtype."""
    monkeypatch.setattr(tns, "INTERPRET", False)  # as on a GPU with compiled kernels
    monkeypatch.setitem(BACKENDS, "triton", replace(BACKENDS["triton"], why_not=lambda device: None))
    cuda = torch.device("cuda")
    assert possible_backends("auto", cuda) == ("torch", "triton")
    assert possible_backends("auto", cuda, torch.bfloat16) == ("torch", "triton")
    assert possible_backends("auto", cuda, torch.float64) == ("torch",)
    with pytest.raises(ValueError, match="ns_dtype"):
        possible_backends("triton", cuda, torch.float64)

    def no_timing(*args):
        raise AssertionError("measured a dtype Triton can't take")

    monkeypatch.setattr(backend_choice, "faster_backend", no_timing)
    assert pick_backend("auto", cuda, (1, 8, 24), torch.float64, NSConfig()) == "torch"


def test_faster_backend_does_not_measure_fp64(fresh_cache, monkeypatch):
    def no_measure(*args):
        raise AssertionError("measured a dtype Triton can't take")

    monkeypatch.setattr(backend_choice, "_measure", no_measure)
    assert backend_choice.faster_backend((1, 8, 24), torch.float64, NSConfig(), torch.device("cpu")) == "torch"


# -------------------------------------------------------------- "auto" and the interpreter (r8), names (r7)


def test_auto_never_offers_the_interpreter():
    """With TRITON_INTERPRET=1 (left set while debugging), "auto" on CUDA would have timed the
    interpreted kernels; backend="triton" still runs them (these tests need it)."""
    if not tns.INTERPRET:
        pytest.skip("needs TRITON_INTERPRET=1 (set by tests/conftest.py on a CPU-only machine)")
    assert possible_backends("auto", torch.device("cuda")) == ("torch",)
    assert possible_backends("triton", torch.device("cpu")) == ("triton",)


@pytest.mark.parametrize("name", ["Triton", "cuda", ""])
def test_unknown_backend_names_raise(name):
    with pytest.raises(ValueError, match="choose one of") as err:
        possible_backends(name, "cpu")
    assert repr(name) in str(err.value) and str(backend_choices()) in str(err.value)
    with pytest.raises(ValueError, match="choose one of"):
        pick_backend(name, "cpu", (1, 8, 16), torch.float32, NSConfig())


# ------------------------------------------------------------------------------ "auto" timing (r3, r9)


def test_measuring_leaves_the_callers_rng_alone(fresh_cache, monkeypatch):
    """The timing input came from the default generator: the first process (or rank) to meet a
    shape advanced its RNG, those finding the shape cached did not."""
    monkeypatch.setattr(torch.cuda, "Event", _HostEvent)
    # the timing, not the kernels (it runs them through execute.run)
    monkeypatch.setattr(backend_choice.execute, "run", lambda X, *args, **kwargs: X)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    backend_choice.faster_backend((1, 8, 24), torch.float32, NSConfig(form="plain"), torch.device("cpu"))
    assert torch.equal(torch.get_rng_state(), before)


def test_deeply_nested_cache_file_reads_as_damaged(tmp_path):
    path = tmp_path / "ns_backend-x.json"
    path.write_text("[" * 100000)
    assert backend_choice._read(path) == {}


# --------------------------------------------------------------------------- launcher checks (r4, r6, r10)


def test_launchers_refuse_an_out_whose_elements_overlap():
    """An expand()ed out (batch stride 0): every batch wrote the same bytes, the last one won."""
    X = _x(3, 8, 16)
    square = torch.zeros(1, 8, 8, device=DEVICE).expand(3, 8, 8)
    with pytest.raises(ValueError, match="share memory"):
        tns.sym_matmul(X, out=square)
    with pytest.raises(ValueError, match="share memory"):
        tns.batched_matmul_add(X[:, :, :8], X, out=torch.zeros(1, 8, 16, device=DEVICE).expand(3, 8, 16))
    assert tns._overlaps_itself(square) and tns._overlaps_itself(torch.zeros(4).as_strided((2, 3), (1, 1)))


def test_launchers_keep_accepting_strided_outs():
    """Sliced and transposed outs are distinct elements: still accepted, and written right."""
    X = _x(2, 8, 16)
    big = torch.full((2, 10, 12), float("nan"), device=DEVICE)
    sliced = big[:, 1:9, 2:10]
    assert not tns._overlaps_itself(sliced) and not tns._overlaps_itself(sliced.mT)
    tns.sym_matmul(X, out=sliced.mT)
    torch.testing.assert_close(sliced, X @ X.mT, rtol=1e-4, atol=1e-4)


def test_disjoint_views_of_one_buffer_are_not_aliases():
    """Buffers carved from one arena (as Workspace does) were refused for sharing a storage."""
    arena = torch.empty(8 * 16 + 8 * 8 + 8 * 16, device=DEVICE)
    X = arena[: 8 * 16].view(1, 8, 16)
    X.copy_(_x(1, 8, 16))
    out = arena[8 * 16: 8 * 16 + 64].view(1, 8, 8)
    tns.sym_matmul(X, out=out)
    torch.testing.assert_close(out, X @ X.mT, rtol=1e-4, atol=1e-4)
    wide = arena[8 * 16 + 64:].view(1, 8, 16)
    tns.batched_matmul_add(out, X, out=wide)
    torch.testing.assert_close(wide, out @ X, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="shares memory with X"):
        tns.sym_matmul(X, out=arena[:64].view(1, 8, 8))  # overlaps X's bytes
    with pytest.raises(ValueError, match="shares memory with Q"):
        tns.batched_matmul_add(out, X, out=arena[:128].view(1, 8, 16))  # Q is X


@pytest.mark.parametrize("out_dtype", [torch.int32, torch.bool, torch.float64])
def test_out_dtype_is_checked_like_out(out_dtype):
    X = _x(1, 8, 16)
    with pytest.raises(ValueError, match="out_dtype"):
        tns.sym_matmul(X, out_dtype=out_dtype)
    with pytest.raises(ValueError, match="out_dtype"):
        tns.batched_matmul_add(X, X.mT, out_dtype=out_dtype)


# ------------------------------------------------------------------------------------ coefficients (r5)


@pytest.mark.parametrize("coefficients", [(3.4445, -4.7750, 2.0315), "keller"])
def test_newton_schulz_triton_refuses_a_preset_name_or_a_bare_triple(coefficients):
    """Both failed inside float() with unrelated messages; NSConfig accepts both, meaning "every
    step", which this function (no step count) can't honour."""
    X = _x(1, 8, 16)
    with pytest.raises(ValueError, match=r"\(a, b, c\) triples.*resolve_coefficients"):
        tns.newton_schulz_triton(X / X.norm(), coefficients)


def test_newton_schulz_triton_checks_entries_through_coefficient_table():
    X = _x(1, 8, 16)
    X = X / X.norm()
    with pytest.raises(TypeError, match="triples"):
        tns.newton_schulz_triton(X, [(1.0, "2", 3.0)])
    with pytest.raises(ValueError, match="finite"):
        tns.newton_schulz_triton(X, [(1.0, float("nan"), 3.0)])
    with pytest.raises(TypeError, match="triples"):
        tns.newton_schulz_triton(X, [(1.0, True, 3.0)])
    # lists of lists and tuples of tuples both run, as before
    assert torch.equal(tns.newton_schulz_triton(X, [list(abc) for abc in KELLER]),
                       tns.newton_schulz_triton(X, tuple(KELLER)))
