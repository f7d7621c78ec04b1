"""newton_schulz's backend dispatch: Triton (interpreted on CPU) equals the torch path."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from muonlab import PRESETS, NSConfig, newton_schulz

triton = pytest.importorskip("triton")


def _triton_device() -> str:
    """Where the Triton kernels can run here: CUDA, else the CPU under the interpreter (else skip)."""
    from muonlab.kernels.triton_newton_schulz import INTERPRET

    if not (torch.cuda.is_available() or INTERPRET):
        pytest.skip("needs CUDA or TRITON_INTERPRET=1 (set by tests/conftest.py)")
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_triton_backend_equals_torch_backend_fp32(preset):
    device = _triton_device()
    gen = torch.Generator().manual_seed(0)
    for shape in [(40, 72), (72, 40), (2, 33, 33)]:
        G = torch.randn(shape, generator=gen).to(device)
        fast = newton_schulz(G, coefficients=preset, dtype=torch.float32, backend="triton")
        ref = newton_schulz(G, coefficients=preset, dtype=torch.float32, backend="torch")
        torch.testing.assert_close(fast, ref, rtol=1e-4, atol=1e-4)


def test_auto_never_picks_the_interpreter_on_cpu():
    if torch.cuda.is_available():
        pytest.skip("has CUDA")
    from muonlab.kernels.newton_schulz import pick_backend

    assert pick_backend("auto", torch.device("cpu"), (1, 2, 2), torch.float32, NSConfig()) == "torch"
    assert pick_backend("auto", "cpu", (1, 2, 8), torch.float32, NSConfig(form="gram")) == "torch"


# the restart patterns on one schedule, the other schedule once: the kernels read a step's
# coefficients as numbers, so the schedule changes no code path (some 7 s a case on the interpreter)
@pytest.mark.parametrize("preset, restarts, steps", [
    ("keller", (2,), 5), ("keller", (), 5), ("keller", (0, 1, 2, 3), 5), ("keller", (2,), 1), ("keller", (2,), 3),
    ("polar_express", (2,), 5)])
def test_triton_gram_form_equals_torch_gram_form_fp32(preset, restarts, steps):
    # the gram form's products on the Triton kernels (X X^T and b R + c R^2 on upper tiles only)
    # against the same iteration on bmm / baddbmm; wide, tall and batched
    device = _triton_device()
    gen = torch.Generator().manual_seed(1)
    for shape in [(24, 72), (72, 24), (3, 17, 40)]:
        G = torch.randn(shape, generator=gen).to(device)
        settings = dict(coefficients=preset, dtype=torch.float32, form="gram", gram_restarts=restarts, steps=steps)
        fast = newton_schulz(G, backend="triton", **settings)
        ref = newton_schulz(G, backend="torch", **settings)
        plain = newton_schulz(G, backend="torch", **{**settings, "form": "plain"})
        assert not torch.equal(ref, plain) or steps == 1  # the gram form ran, not the plain one
        torch.testing.assert_close(fast, ref, rtol=1e-4, atol=1e-4)


def test_triton_gram_form_in_a_warm_workspace_allocates_nothing_and_writes_every_element():
    from torch.profiler import ProfilerActivity, profile

    from muonlab.kernels.triton_newton_schulz import INTERPRET
    from muonlab.kernels.workspace import Workspace

    if not (torch.cuda.is_available() or INTERPRET) or torch.cuda.is_available():
        pytest.skip("CPU memory profile under TRITON_INTERPRET=1")
    G = torch.randn(2, 40, 16, generator=torch.Generator().manual_seed(2))
    ws = Workspace()
    settings = dict(dtype=torch.float32, form="gram", backend="triton")
    first = newton_schulz(G, workspace=ws, **settings)
    ws.take(torch.device("cpu"), [((ws.nbytes // 4,), torch.float32)])[0].fill_(float("nan"))  # stale bytes
    out = torch.full_like(G, float("nan"))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        newton_schulz(G, workspace=ws, out=out, **settings)
    assert torch.equal(out, first) and not out.isnan().any()
    largest = max(e.cpu_memory_usage for e in prof.events())
    assert largest < 16 * 16 * 4, largest


def test_muonlab_imports_and_runs_without_triton():
    code = textwrap.dedent("""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name == "triton" or name.startswith("triton."):
                    raise ImportError("triton hidden for this test")
        sys.meta_path.insert(0, Block())
        import torch, muonlab
        from muonlab.kernels.triton_newton_schulz import TRITON_AVAILABLE
        assert not TRITON_AVAILABLE
        p = torch.nn.Parameter(torch.randn(8, 16))
        opt = muonlab.Muon([p], ns_backend="auto")
        p.grad = torch.randn(8, 16)
        opt.step()
        print("ok", muonlab.ns_flops((8, 16)))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ok")


def test_gram_flops_on_triton_count_the_symmetric_products_half():
    from muonlab import ns_flops

    m, n = 64, 256
    torch_count = ns_flops((m, n), form="gram")  # 5 steps, a restart after step 2
    # R_0 and the restart's X X^T (2 m^2 n each) and the five R R (2 m^3 each) run on upper tiles
    assert ns_flops((m, n), form="gram", backend="triton") == torch_count - 2 * m * m * n - 5 * m**3
    assert ns_flops((m, n), form="gram", backend="auto") == torch_count  # "auto" counts as torch


@pytest.mark.parametrize("form", ["plain", "gram"])
def test_triton_chunks_count_the_triton_bytes_and_stay_within_the_budget(form):
    """The Triton path holds one m x n more per matrix than the torch path (its iterates are wide
    workspace buffers, the output a copy), so a runner on Triton cuts smaller chunks; the arena of
    one chunk, plus that chunk's input and output, stays within the budget."""
    from muonlab.kernels.runner import NewtonSchulzRunner, matrices_within
    from muonlab.kernels.workspace import batch_bytes_per_matrix

    device = _triton_device()
    m, n, item = 8, 64, 4
    per_matrix = batch_bytes_per_matrix(m, n, item, form=form, backend="triton")
    assert per_matrix == item * (4 * m * n + (4 if form == "gram" else 2) * m * m)
    budget = 4 * per_matrix
    torch_cfg, triton_cfg = (NSConfig(dtype=torch.float32, form=form, backend=b) for b in ("torch", "triton"))
    assert matrices_within(budget, (m, n), torch.float32, torch_cfg, device=device) == 5
    assert matrices_within(budget, (m, n), torch.float32, triton_cfg, device=device) == 4
    mats = torch.randn(9, m, n, generator=torch.Generator().manual_seed(0)).to(device)
    runner = NewtonSchulzRunner(budget)
    fast = runner(mats, triton_cfg)
    assert runner.chunk_size((m, n), torch.float32, cfg=triton_cfg, device=device) == 4
    assert runner.workspace.nbytes + 2 * 4 * m * n * item <= budget  # arena + a chunk's input and output
    torch.testing.assert_close(fast, newton_schulz(mats, torch_cfg), rtol=1e-4, atol=1e-4)


def test_triton_where_it_cant_run_is_refused_at_construction_before_any_change():
    """Chunks are sized for the backend that runs them, so ns_backend="triton" off CUDA (without the
    interpreter) is refused when the optimizer is made, naming the device and the reason; the
    parameter is unchanged."""
    if torch.cuda.is_available():
        pytest.skip("has CUDA")
    script = textwrap.dedent("""
        import torch, muonlab
        p = torch.nn.Parameter(torch.randn(16, 32)); before = p.detach().clone()
        p.grad = torch.randn(16, 32)
        try:
            muonlab.Muon([p], lr=0.02, ns_backend="triton")
        except ValueError as e:
            print("refused:", e)
        print("unchanged:", torch.equal(p.detach(), before))
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert "refused: ns_backend='triton' can't run on parameter of shape (16, 32)" in out.stdout, out.stderr
    assert "backend='triton' needs triton installed and a CUDA tensor" in out.stdout
    assert "got device cpu" in out.stdout
    assert out.stdout.strip().endswith("unchanged: True")
