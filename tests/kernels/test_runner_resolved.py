"""The runner resolves a batch key once and runs each chunk on the executor: the same bits as the
public one-shot ``newton_schulz`` on the same matrices, the same errors, and a number of Python
calls per call that does not grow with the number of pieces it is handed.
"""

from __future__ import annotations

import sys

import pytest
import torch

from muonlab.kernels.config import form_for
from muonlab.kernels.batch_io import Overwrite
from muonlab.kernels.config import NSConfig
from muonlab.kernels.newton_schulz import newton_schulz, work_dtype
from muonlab.kernels.runner import NewtonSchulzRunner
from muonlab.kernels.workspace import batch_bytes_per_matrix

SHAPES = {"wide": (24, 40), "tall": (40, 24), "square": (24, 24)}
# (form, compute dtype, input dtype): fp32 iterates, bf16 iterates (the plain form's, from fp32
# inputs and from bf16 ones), and the gram form from a 16-bit compute dtype (fp32 or fp16 iterates)
SETTINGS = [("plain", torch.float32, torch.float32), ("plain", torch.bfloat16, torch.float32),
            ("plain", torch.bfloat16, torch.bfloat16), ("gram", torch.float32, torch.float32),
            ("gram", torch.bfloat16, torch.float32)]
COUNTS = (3, 1, 2, 1)  # matrices per piece: 7 in all
CHUNKS = (3, 2, 2)  # 7 matrices under a budget of 3, as even as can be


def _pieces(layout: str, shape, dtype, seed: int = 0) -> list[torch.Tensor]:
    """(k, A, B) pieces of ``COUNTS`` matrices: back to back in one buffer, or each its own."""
    g = torch.Generator().manual_seed(seed)
    rows, cols = shape
    if layout == "joined":
        flat = torch.randn(sum(COUNTS) * rows * cols, generator=g).to(dtype)
        bounds = [sum(COUNTS[:i]) * rows * cols for i in range(len(COUNTS) + 1)]
        return [flat[a:b].view(-1, rows, cols) for a, b in zip(bounds, bounds[1:])]
    return [torch.randn(k, rows, cols, generator=g).to(dtype) for k in COUNTS]


def _budget(cfg: NSConfig, shape, dtype, input_dtype, matrices: int, reuses_input: bool) -> int:
    """Bytes for ``matrices`` matrices per chunk (the runner's own count, checked by the caller)."""
    form = form_for(cfg, shape)
    per = batch_bytes_per_matrix(min(shape), max(shape), dtype.itemsize, reuses_input, form,
                                 input_itemsize=input_dtype.itemsize,
                                 work_itemsize=work_dtype(cfg, form, dtype, "cpu").itemsize)
    return matrices * per


def _expected(kind: str, pieces: list[torch.Tensor], cfg: NSConfig, bounds) -> torch.Tensor:
    """``newton_schulz`` on the same matrices, one call per chunk (``bounds``: the chunks' sizes)."""
    stack = torch.cat([p.clone() for p in pieces])
    starts = [sum(bounds[:i]) for i in range(len(bounds) + 1)]
    if kind == "overwrite":  # the chunk's own matrices overwritten, as the runner's Overwrite pieces are
        for a, b in zip(starts, starts[1:]):
            newton_schulz(Overwrite([stack[a:b]]), cfg)
        return stack
    return torch.cat([newton_schulz(stack[a:b], cfg) for a, b in zip(starts, starts[1:])])


@pytest.mark.parametrize("chunked", [False, True], ids=["one-chunk", "chunked"])
@pytest.mark.parametrize("kind, layout", [("stack", "joined"), ("list", "apart"), ("overwrite", "joined"),
                                          ("overwrite", "apart")])
@pytest.mark.parametrize("shape", list(SHAPES.values()), ids=list(SHAPES))
@pytest.mark.parametrize("form, dtype, input_dtype", SETTINGS,
                         ids=[f"{f}-{str(d)[6:]}-from-{str(i)[6:]}" for f, d, i in SETTINGS])
def test_the_runner_gives_the_bits_of_newton_schulz(form, dtype, input_dtype, shape, kind, layout, chunked):
    cfg = NSConfig(dtype=dtype, form=form, backend="torch")
    pieces = _pieces(layout, shape, input_dtype)
    reuses_input = kind == "overwrite" and input_dtype == dtype
    matrices = CHUNKS[0] if chunked else sum(COUNTS)
    runner = NewtonSchulzRunner(_budget(cfg, shape, dtype, input_dtype, matrices, reuses_input))
    assert runner.chunk_size(shape, dtype, reuses_input, cfg, "cpu", input_dtype) == matrices
    expected = _expected(kind, pieces, cfg, CHUNKS if chunked else (sum(COUNTS),))
    if kind == "stack":
        got = runner(torch.cat(pieces).view(-1, 1, *shape), cfg)  # any leading dims
        assert got.shape == (sum(COUNTS), 1, *shape)
        got = got.view(-1, *shape)
    elif kind == "list":
        got = runner(pieces, cfg)
    else:
        mats = Overwrite(pieces)
        assert runner(mats, cfg) is mats
        got = torch.cat(list(mats))
    assert got.dtype == expected.dtype and torch.equal(got, expected)
    assert runner.ran[shape]["dtype"] == str(dtype)[6:]


def _calls(fn) -> int:
    """Python call events (generators' resumptions and comprehensions included) of ``fn()``."""
    count, previous = [0], sys.getprofile()

    def profile(frame, event, arg):
        if event == "call":
            count[0] += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(previous)
    return count[0]


@pytest.mark.parametrize("form", ["plain", "gram"])
@pytest.mark.parametrize("layout", ["joined", "apart"])
def test_a_runner_call_makes_as_many_python_calls_for_8_pieces_as_for_32(form, layout):
    """Per plan batch of every step: the checks and joins of the pieces, the choices and the
    chunk loop cost no Python call per piece."""
    cfg = NSConfig(dtype=torch.float32, form=form, backend="torch")
    rows, cols = 16, 48
    counts = {}
    for k in (8, 32):
        g = torch.Generator().manual_seed(k)
        if layout == "joined":
            flat = torch.randn(k * rows * cols, generator=g)
            pieces = [flat[i * rows * cols:(i + 1) * rows * cols].view(1, rows, cols) for i in range(k)]
        else:
            pieces = [torch.randn(1, rows, cols, generator=g) for _ in range(k)]
        runner = NewtonSchulzRunner(2**24)  # one chunk either way
        runner(Overwrite(pieces), cfg)  # decides
        with torch.no_grad():
            counts[k] = _calls(lambda: runner(Overwrite(pieces), cfg))
    assert counts[8] == counts[32], counts


def test_a_decided_batch_resolves_nothing_again():
    """A second call of the same batch key, in chunks, calls none of the functions that make the
    choices (dtype, form, schedule, backend, config): they were made once, at the first call."""
    cfg = NSConfig(dtype=torch.float32, form="gram", coefficients="polar_express", backend="auto")
    mats = torch.randn(7, 16, 48)
    runner = NewtonSchulzRunner(3 * batch_bytes_per_matrix(16, 48, 4, form="gram"))
    first = runner(mats, cfg)
    names = []

    def profile(frame, event, arg):
        if event == "call":
            names.append(frame.f_code.co_name)

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        again = runner(mats, cfg)
    finally:
        sys.setprofile(previous)
    assert torch.equal(again, first)
    assert names.count("run_resolved") == 3  # three chunks
    choices = {"newton_schulz", "compute_dtype", "resolve_dtype", "checked_form", "_form", "work_dtype",
               "schedule_of", "refusal", "check", "pick_backend", "possible_backends", "usable", "_config",
               "resolve", "resolved_coefficients", "norm_scale", "matrices_within", "_decide"}
    assert not choices & set(names), choices & set(names)


@pytest.mark.parametrize("mats, cfg, error, match", [
    (lambda: Overwrite([torch.ones(2, 4, 8, dtype=torch.int64)]), NSConfig(dtype=None), TypeError,
     "G has dtype torch.int64; with dtype=None"),
    (lambda: Overwrite([torch.randn(2, 8, 24).bfloat16()]), NSConfig(dtype=None, coefficients="cans"), ValueError,
     "schedule 'cans' .* may not iterate in bfloat16"),
    (lambda: Overwrite([torch.randn(2, 8, 24), torch.randn(1, 8, 23)]), NSConfig(), ValueError,
     "list mats needs tensors of one device and dtype with equal last two dims; tensor 1 is \\(1, 8, 23\\)"),
    (lambda: Overwrite([torch.randn(2, 8, 24), torch.randn(8)]), NSConfig(), ValueError, "tensor 1 is \\(8,\\)"),
    (lambda: Overwrite([torch.randn(2, 8, 24), "x"]), NSConfig(), TypeError,
     "needs mats as a tensor or a non-empty list of tensors"),
])
def test_the_runner_refuses_as_newton_schulz_does_before_writing(mats, cfg, error, match):
    mats = mats()
    before = [m.clone() if isinstance(m, torch.Tensor) else m for m in mats]
    with pytest.raises(error, match=match):
        NewtonSchulzRunner(2**20)(mats, cfg)
    assert all(torch.equal(a, b) for a, b in zip(mats, before) if isinstance(a, torch.Tensor))
