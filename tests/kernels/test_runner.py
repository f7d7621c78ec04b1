"""The bounded-memory Newton-Schulz path: workspace reuse, chunking, graphs, backend="auto".

Every fast path is checked against the plain one-call ``newton_schulz`` (bit for bit where the
arithmetic is the same), and the optimizer's chunked step against its unchunked step.
"""

from __future__ import annotations

import json

import pytest
import torch

import muonlab
from muonlab.kernels import backend_choice
from muonlab.kernels.batch_io import Overwrite
from muonlab.kernels.config import NSConfig
from muonlab.kernels.newton_schulz import cpu_has_native_bf16, newton_schulz, resolve_dtype
from muonlab.kernels.runner import NewtonSchulzRunner, default_budget, matrices_within
from muonlab.kernels.workspace import ALIGN, Workspace, max_batch_matrices

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (graphs, backend='auto' measurement)")


@pytest.mark.parametrize("shape", [(3, 24, 40), (3, 40, 24), (24, 24), (2, 2, 16, 9)])
@pytest.mark.parametrize("form", ["plain", "gram"])
def test_workspace_gives_the_same_bits_and_leaves_the_input_alone(shape, form):
    G = torch.randn(shape)
    before = G.clone()
    cfg = NSConfig(dtype=torch.float32, form=form)
    ws = Workspace()
    first = newton_schulz(G, cfg, workspace=ws)
    again = newton_schulz(G, cfg, workspace=ws)  # the buffers now hold the last call's iterates
    assert torch.equal(first, newton_schulz(G, cfg)) and torch.equal(again, first)
    assert torch.equal(G, before)
    assert first.data_ptr() != again.data_ptr()  # results never live in the workspace


def test_workspace_reuses_one_arena_and_grows_when_needed():
    ws = Workspace()
    a, b = ws.take("cpu", [((4, 8), torch.float32), ((3,), torch.bfloat16)])
    assert (b.data_ptr() - a.data_ptr()) % ALIGN == 0  # every buffer starts on an ALIGN boundary of the arena
    assert b.data_ptr() >= a.data_ptr() + a.nbytes  # disjoint
    (c,) = ws.take("cpu", [((4, 8), torch.float32)])
    assert c.data_ptr() == a.data_ptr()  # the same memory, reused
    held = ws.nbytes
    (big,) = ws.take("cpu", [((1000,), torch.float64)])
    assert ws.nbytes >= 8000 > held and big.shape == (1000,)


def test_a_chunks_buffers_are_carved_once_and_dropped_when_the_arena_grows():
    """The executor keeps each chunk shape's buffers (``Workspace.carved``): the same views at every
    call, and none left pointing into an arena the workspace replaced."""
    runner = NewtonSchulzRunner(2**30)
    cfg = NSConfig(dtype=torch.float32, form="plain", backend="torch")
    small = Overwrite([torch.randn(3, 8, 16)])
    runner(small, cfg)
    (carved,) = runner.workspace.carved.values()
    runner(Overwrite([torch.randn(3, 8, 16)]), cfg)
    assert [b.data_ptr() for b in next(iter(runner.workspace.carved.values()))] == [b.data_ptr() for b in carved]
    assert all(a is b for a, b in zip(next(iter(runner.workspace.carved.values())), carved))  # kept, not carved again
    runner(Overwrite([torch.randn(5, 32, 64)]), cfg)  # a larger chunk: a new arena
    arena = runner.workspace._arenas[torch.device("cpu")]
    assert all(b.untyped_storage().data_ptr() == arena.untyped_storage().data_ptr()
               for bufs in runner.workspace.carved.values() for b in bufs)
    expected = newton_schulz(torch.randn(3, 8, 16, generator=torch.Generator().manual_seed(1)), cfg)
    again = Overwrite([torch.randn(3, 8, 16, generator=torch.Generator().manual_seed(1))])
    runner(again, cfg)  # carved anew in the new arena, the same bits as a one-shot call
    assert torch.equal(again[0], expected)


def test_out_is_checked():
    G = torch.randn(2, 8, 12)
    for wrong in (torch.empty(3, 8, 12), torch.empty(2, 12, 8), [torch.empty(1, 8, 12)], torch.empty(2, 8, 12).long()):
        with pytest.raises(ValueError, match="out must hold 2 matrices of shape"):
            newton_schulz(G, NSConfig(dtype=torch.float32), out=wrong)
    with pytest.raises(ValueError, match="list out needs tensors of one device and dtype"):
        newton_schulz(G, NSConfig(dtype=torch.float32), out=[torch.empty(1, 8, 12), torch.empty(1, 8, 12).double()])


@pytest.mark.parametrize("rows, cols", [(20, 36), (36, 20), (24, 24)])
@pytest.mark.parametrize("form", ["plain", "gram"])
def test_pieces_in_and_out_give_the_bits_of_the_stacked_call(rows, cols, form):
    """A list of pieces is read as their concatenation, and ``out`` may be pieces of another dtype
    or the input itself: the same bits as one call on the stack, cast once."""
    torch.manual_seed(0)
    pieces = [torch.randn(2, rows, cols), torch.randn(rows, cols), torch.randn(0, rows, cols), torch.randn(3, rows, cols)]
    cfg = NSConfig(dtype=torch.float32, form=form)
    stacked = newton_schulz(torch.cat([p.view(-1, rows, cols) for p in pieces]), cfg)
    assert torch.equal(newton_schulz(pieces, cfg), stacked)
    into = [torch.empty_like(p, dtype=torch.bfloat16) for p in pieces]
    assert newton_schulz(pieces, cfg, out=into) is into
    assert torch.equal(torch.cat([t.view(-1, rows, cols) for t in into]), stacked.bfloat16())
    own = [p.clone() for p in pieces]
    newton_schulz(own, cfg, out=own)  # over its own input
    assert torch.equal(torch.cat([t.view(-1, rows, cols) for t in own]), stacked)


@pytest.mark.parametrize("steps", [4, 5])
@pytest.mark.parametrize("rows, cols", [(20, 36), (36, 20)])
@pytest.mark.parametrize("form, restarts", [("plain", (2,)), ("gram", (2,)), ("gram", ()), ("gram", (0, 1))])
def test_out_as_an_iterate_buffer_gives_the_same_bits(steps, rows, cols, form, restarts):
    """A contiguous ``out`` in the compute dtype is one of the two iterate buffers (the input goes
    into the one that makes an odd or even number of writes end in ``out``: steps for the plain
    form, restarts + 1 for the gram form), and it may be G itself, given as pieces that lie back
    to back in one buffer: the same bits as a call that copies its result out."""
    torch.manual_seed(2)
    flat = torch.randn(5 * rows * cols)
    cfg = NSConfig(dtype=torch.float32, steps=steps, form=form, gram_restarts=restarts)
    expected = newton_schulz(flat.view(5, rows, cols).clone(), cfg)
    separate = torch.empty(5, rows, cols)
    assert newton_schulz(flat.view(5, rows, cols), cfg, out=separate) is separate
    assert torch.equal(separate, expected)
    pieces = [flat[: 2 * rows * cols].view(2, rows, cols), flat[2 * rows * cols:].view(3, rows, cols)]
    newton_schulz(pieces, cfg, out=pieces)  # joined into one view of `flat`, overwritten in place
    assert torch.equal(flat.view(5, rows, cols), expected)
    strided = torch.empty(rows, cols, 5).permute(2, 0, 1)  # not contiguous: the result is copied in
    assert torch.equal(newton_schulz(expected, cfg, out=strided), newton_schulz(expected, cfg))
    with pytest.raises(ValueError, match="can't be viewed as a batch of matrices"):
        newton_schulz(torch.randn(2, 3, rows, cols), cfg, out=torch.empty(3, 2, rows, cols).transpose(0, 1))


def test_newton_schulz_itself_honours_overwrite():
    torch.manual_seed(3)
    pieces = [torch.randn(2, 20, 36), torch.randn(1, 20, 36)]
    cfg = NSConfig(dtype=torch.float32)
    expected = newton_schulz(torch.cat(pieces), cfg)
    handed = Overwrite(pieces)
    assert newton_schulz(handed, cfg) is handed  # no output of its own: the pieces hold the result
    assert torch.equal(torch.cat(pieces), expected)


@pytest.mark.parametrize("budget_matrices", [1, 2, 4])
def test_runner_overwrites_its_pieces_chunk_by_chunk(budget_matrices):
    """``Overwrite`` pieces get the result in place, with chunks cut across the pieces' borders,
    and allocate no output: the same bits as one call on the stack."""
    torch.manual_seed(1)
    pieces = [torch.randn(3, 36, 20), torch.randn(1, 36, 20), torch.randn(2, 36, 20)]
    cfg = NSConfig(dtype=torch.float32)
    expected = newton_schulz(torch.cat(pieces), cfg)
    runner = NewtonSchulzRunner(budget_matrices * 4 * (2 * 20 * 36 + 2 * 20 * 20))
    assert runner.chunk_size((36, 20), torch.float32, reuses_input=True) == budget_matrices
    ptrs = [p.data_ptr() for p in pieces]
    result = runner(Overwrite(pieces), cfg)
    assert [p.data_ptr() for p in result] == ptrs
    assert torch.equal(torch.cat(pieces), expected)


def test_max_batch_matrices_fits_the_budget_and_is_at_least_one():
    per = 2 * (3 * 64 * 256 + 2 * 64 * 64)  # bf16: input, an iterate, the output 64 x 256, two 64 x 64 products
    assert max_batch_matrices((256, 64), 2, 10 * per) == 10
    assert max_batch_matrices((64, 256), 2, 10 * per + per - 1) == 10
    assert max_batch_matrices((64, 256), 2, 1) == 1
    reused = 2 * (2 * 64 * 256 + 2 * 64 * 64)  # the input is the output too
    assert max_batch_matrices((64, 256), 2, 10 * reused, reuses_input=True) == 10
    gram = 2 * (3 * 64 * 256 + 4 * 64 * 64)  # the gram form: R, Z, Q and one product in flight
    assert max_batch_matrices((64, 256), 2, 10 * gram, form="gram") == 10
    assert default_budget(0) == 256 * 2**20 and default_budget(100 * 2**30) == 5 * 2**30
    assert default_budget(0, "cpu") == 8 * 2**20 and default_budget(100 * 2**30, "cpu") == 5 * 2**30


@pytest.mark.parametrize("budget_matrices", [1, 2, 3, 7])
def test_chunked_runner_matches_one_call(budget_matrices):
    mats = torch.randn(7, 20, 36)
    cfg = NSConfig(dtype=torch.float32)
    runner = NewtonSchulzRunner(budget_matrices * 4 * (3 * 20 * 36 + 2 * 20 * 20))
    assert runner.chunk_size((20, 36), torch.float32) == budget_matrices
    assert torch.equal(runner(mats, cfg), newton_schulz(mats, cfg))


@pytest.mark.parametrize("form, chunks", [("gram", [2, 2, 2, 1]), ("plain", [3, 2, 2])])
def test_runner_budgets_the_form_that_runs(form, chunks, monkeypatch):
    # 16 x 64: the gram form saves 40% of the FLOPs, so it runs there even under gram_min_saving
    import muonlab.kernels.runner as runner_module

    cfg = NSConfig(dtype=torch.float32, form=form, gram_min_saving=0.2)
    seen = []
    real = runner_module.run_resolved  # each chunk's run, its choices made
    monkeypatch.setattr(runner_module, "run_resolved",
                        lambda mats, *a: seen.append(sum(p.shape[0] for p in mats)) or real(mats, *a))
    runner = NewtonSchulzRunner(3 * 4 * (3 * 16 * 64 + 2 * 16 * 16))  # three plain matrices, two gram
    mats = torch.randn(7, 16, 64)
    assert torch.equal(runner(mats, cfg), newton_schulz(mats, cfg))
    assert seen == chunks


def _bf16_model_and_grads(seed=0):
    torch.manual_seed(seed)
    shapes = [(48, 32)] * 5 + [(32, 32)] * 3 + [(4, 16, 24)]
    params = [torch.nn.Parameter(torch.randn(s).bfloat16()) for s in shapes]
    grads = [[torch.randn(s).bfloat16() for s in shapes] for _ in range(3)]
    return params, grads


def _run(params, grads, **kw):
    params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = muonlab.Muon(params, lr=0.05, weight_decay=0.01, **kw)
    for step in grads:
        for p, g in zip(params, step):
            p.grad = g.clone()
        opt.step()
    return opt, params


def test_a_small_workspace_splits_batches_and_steps_the_same():
    """Chunked (budget of about one matrix) and unchunked steps are bit-identical."""
    params, grads = _bf16_model_and_grads()
    big, ref = _run(params, grads, ns_dtype=torch.float32)
    small, got = _run(params, grads, ns_dtype=torch.float32, workspace_bytes=4 * (4 * 32 * 48 + 2 * 32 * 32))
    assert len(small.plan()) > len(big.plan())
    assert max(b.num_matrices for b in small.plan() if b.matrix_shape == (48, 32)) == 1
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
    for a, b in zip(ref, got):
        assert torch.equal(big.state[a]["momentum_buffer"], small.state[b]["momentum_buffer"])


def test_momentum_dtype_fp32_keeps_fp32_state_and_differs_from_bf16():
    params, grads = _bf16_model_and_grads()
    opt16, p16 = _run(params, grads)
    opt32, p32 = _run(params, grads, momentum_dtype=torch.float32)
    assert all(opt16.state[p]["momentum_buffer"].dtype == torch.bfloat16 for p in p16)
    assert all(opt32.state[p]["momentum_buffer"].dtype == torch.float32 for p in p32)
    assert any(not torch.equal(a, b) for a, b in zip(p16, p32))  # the option does something


@pytest.mark.parametrize("kw, match", [
    (dict(momentum_dtype=torch.int32), "momentum_dtype must be a floating dtype"),
    (dict(momentum_dtype="fp32"), "momentum_dtype must be a torch dtype"),
    (dict(workspace_bytes=0), "workspace_bytes must be >= 1"),
    (dict(workspace_bytes=1.5), "workspace_bytes must be an int"),
    (dict(ns_graphs=1), "ns_graphs must be a bool"),
    (dict(ns_dtype="fast"), "ns_dtype"),
])
def test_bad_memory_options_are_refused_by_name(kw, match):
    with pytest.raises((ValueError, TypeError), match=match):
        muonlab.Muon([torch.nn.Parameter(torch.randn(4, 4))], **kw)


def test_ns_dtype_auto_follows_the_device():
    expected_cpu = torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    assert resolve_dtype("auto", torch.device("cpu")) == expected_cpu
    assert resolve_dtype("auto", torch.device("cuda", 0)) == torch.bfloat16
    assert resolve_dtype(torch.float16, torch.device("cpu")) == torch.float16
    assert resolve_dtype(None, torch.device("cpu")) is None
    assert newton_schulz(torch.randn(64, 64)).dtype == expected_cpu
    assert newton_schulz(torch.randn(8, 8)).dtype == torch.float32  # small: fp32 on every CPU


@pytest.mark.parametrize("flags", [("avx512_bf16",), ()], ids=["native-bf16", "no-bf16"])
def test_ns_dtype_auto_on_a_cpu_follows_the_matrix_size(flags, monkeypatch):
    """On a CPU with native bf16 matmul, small matrices (m^2 n at most CPU_FP32_MAX_WORK) still
    take fp32, in either orientation; without it every size does; CUDA is bf16 whatever the size."""
    import sys

    ns = sys.modules["muonlab.kernels.newton_schulz"]
    monkeypatch.setattr(ns, "cpu_flags", lambda wanted: tuple(f for f in flags if f in wanted))
    cpu, large = torch.device("cpu"), torch.bfloat16 if flags else torch.float32
    edge = ns.CPU_FP32_MAX_WORK // (32 * 32)  # a 32 x edge matrix: m^2 n right at the limit
    for shape, want in [((8, 8), torch.float32), ((32, edge), torch.float32), ((edge, 32), torch.float32),
                        ((32, edge + 1), large), ((64, 64), large), ((3, 256, 256), large), (None, large)]:
        assert resolve_dtype("auto", cpu, shape) == want, shape
    assert resolve_dtype("auto", torch.device("cuda", 0), (8, 8)) == torch.bfloat16
    assert resolve_dtype(torch.bfloat16, cpu, (8, 8)) == torch.bfloat16  # a dtype given is kept


def test_backend_choice_is_cached_on_disk_per_device_and_versions(tmp_path, monkeypatch):
    """The measurement itself needs CUDA; its bookkeeping is checked here with a stand-in
    measurement that counts its calls."""
    monkeypatch.setenv("MUONLAB_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(backend_choice, "_memory", {})
    calls = []
    monkeypatch.setattr(backend_choice, "_measure", lambda *a: calls.append(a) or "triton")
    cfg, cpu = NSConfig(), torch.device("cuda" if torch.cuda.is_available() else "cpu")  # both backends run there
    assert backend_choice.faster_backend((2, 16, 32), torch.bfloat16, cfg, cpu) == "triton"
    assert backend_choice.faster_backend((2, 16, 32), torch.bfloat16, cfg, cpu) == "triton"
    assert len(calls) == 1  # measured once
    path = backend_choice.cache_file(cpu)
    safe_version = "".join(ch if ch.isalnum() else "_" for ch in torch.__version__)
    assert path.parent == tmp_path and safe_version in path.name
    assert list(json.loads(path.read_text()).values()) == ["triton"]
    # a new process (empty memory) reads the file instead of measuring
    monkeypatch.setattr(backend_choice, "_memory", {})
    assert backend_choice.faster_backend((2, 16, 32), torch.bfloat16, cfg, cpu) == "triton"
    assert len(calls) == 1
    backend_choice.faster_backend((2, 16, 48), torch.bfloat16, cfg, cpu)  # another shape: measured
    assert len(calls) == 2
    # the gram form's chain is another chain: its own key, and so are its restarts
    backend_choice.faster_backend((2, 16, 48), torch.bfloat16, NSConfig(form="gram"), cpu)
    backend_choice.faster_backend((2, 16, 48), torch.bfloat16, NSConfig(form="gram", gram_restarts=()), cpu)
    assert len(calls) == 4


@cuda
def test_graphed_runner_matches_eager_and_replays():
    mats = torch.randn(5, 64, 96, device="cuda")
    for backend in ("torch", "triton"):
        cfg = NSConfig(dtype=torch.bfloat16, backend=backend)
        eager = NewtonSchulzRunner(2**30)(mats, cfg)
        # room for two matrices as this backend runs them (Triton's wide iterates take more): chunks of 2, 2, 1
        per_matrix = 2**30 // matrices_within(2**30, (64, 96), torch.bfloat16, cfg, device=mats.device,
                                              input_dtype=mats.dtype)
        runner = NewtonSchulzRunner(2 * per_matrix + per_matrix // 2, graphs=True)
        assert runner.chunk_size((64, 96), torch.bfloat16, cfg=cfg, device=mats.device, input_dtype=mats.dtype) == 2
        first = runner(mats, cfg)
        again = runner(mats * 2, cfg)  # replay with new inputs (normalisation makes the scale irrelevant)
        assert len(runner._graphed) == 2
        torch.testing.assert_close(first, eager, rtol=0, atol=0)
        torch.testing.assert_close(again, eager, rtol=2e-2, atol=2e-2)


@cuda
def test_triton_gram_form_is_close_to_torch_gram_in_bf16_and_replays_in_a_graph():
    mats = torch.randn(5, 64, 192, device="cuda")
    on = {backend: NSConfig(dtype=torch.bfloat16, form="gram", backend=backend) for backend in ("torch", "triton")}
    eager = {backend: NewtonSchulzRunner(2**30)(mats, cfg).float() for backend, cfg in on.items()}
    # two kernels' bf16 roundings of the same iteration (each ~1e-2 from fp32)
    assert ((eager["triton"] - eager["torch"]).norm() / eager["torch"].norm()).item() < 3e-2
    runner = NewtonSchulzRunner(2**30, graphs=True)
    torch.testing.assert_close(runner(mats, on["triton"]).float(), eager["triton"], rtol=0, atol=0)
    torch.testing.assert_close(runner(mats, on["triton"]).float(), eager["triton"], rtol=0, atol=0)  # replayed


@cuda
def test_graphed_and_auto_optimizer_steps_match_eager_torch():
    shapes = [(256, 128)] * 4 + [(128, 128)] * 2
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, device="cuda").bfloat16()) for s in shapes]
    grads = [[torch.randn(s, device="cuda").bfloat16() for s in shapes] for _ in range(3)]
    _, ref = _run(params, grads, ns_backend="torch")
    for kw in (dict(ns_backend="torch", ns_graphs=True), dict(ns_backend="auto"), dict(ns_backend="auto", ns_graphs=True)):
        _, got = _run(params, grads, **kw)
        for a, b in zip(ref, got):
            torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3, msg=str(kw))


def test_pieces_back_to_back_in_one_buffer_are_read_as_one_tensor():
    from muonlab.kernels.execute import joined as _joined

    flat = torch.randn(6 * 4 * 5)
    pieces = [flat[:40].view(2, 4, 5), flat[40:40].view(0, 4, 5), flat[40:].view(4, 4, 5)]
    (one,) = _joined(pieces)
    assert one.shape == (6, 4, 5) and one.data_ptr() == flat.data_ptr() and torch.equal(one.flatten(), flat)
    apart = [torch.randn(2, 4, 5), torch.randn(4, 4, 5)]
    assert _joined(apart) == apart
    assert len(_joined([flat[40:].view(4, 4, 5), flat[:40].view(2, 4, 5)])) == 2  # out of order


def test_chunks_are_as_even_as_can_be_across_pieces():
    from muonlab.kernels.runner import _chunks

    def sizes(counts, size):
        pieces = [torch.zeros(k, 2, 3) for k in counts]
        return [(start, sum(p.shape[0] for p in chunk)) for start, chunk in _chunks(pieces, size)]

    assert sizes([64], 30) == [(0, 22), (22, 21), (43, 21)]
    assert sizes([3, 0, 21], 7) == [(0, 6), (6, 6), (12, 6), (18, 6)]
    assert sizes([5], 8) == [(0, 5)] and sizes([0], 4) == []


def test_a_backend_choice_cache_entry_that_names_no_backend_is_measured_again(tmp_path, monkeypatch):
    monkeypatch.setenv("MUONLAB_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(backend_choice, "_memory", {})
    calls = []
    monkeypatch.setattr(backend_choice, "_measure", lambda *a: calls.append(a) or "torch")
    cfg, cpu = NSConfig(), torch.device("cuda" if torch.cuda.is_available() else "cpu")  # both backends run there
    path = backend_choice.cache_file(cpu)
    path.write_text(json.dumps({backend_choice._key((2, 16, 32), torch.bfloat16, cfg): 5}))
    assert backend_choice.faster_backend((2, 16, 32), torch.bfloat16, cfg, cpu) == "torch"
    assert len(calls) == 1 and list(json.loads(path.read_text()).values()) == ["torch"]
