"""newton_schulz's backend dispatch: Triton (interpreted on CPU) equals the torch path."""

import subprocess
import sys
import textwrap

import pytest
import torch

from muonlab import PRESETS, NSConfig, newton_schulz

triton = pytest.importorskip("triton")


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_triton_backend_equals_torch_backend_fp32(preset):
    from muonlab.kernels.triton_newton_schulz import INTERPRET

    if not (torch.cuda.is_available() or INTERPRET):
        pytest.skip("needs CUDA or TRITON_INTERPRET=1 (set by tests/conftest.py)")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(0)
    for shape in [(40, 72), (72, 40), (2, 33, 33)]:
        G = torch.randn(shape, generator=gen).to(device)
        fast = newton_schulz(G, coefficients=preset, dtype=torch.float32, backend="triton")
        ref = newton_schulz(G, coefficients=preset, dtype=torch.float32, backend="torch")
        torch.testing.assert_close(fast, ref, rtol=1e-4, atol=1e-4)


def test_auto_never_picks_the_interpreter_on_cpu():
    if torch.cuda.is_available():
        pytest.skip("has CUDA")
    from muonlab.kernels.newton_schulz import _pick_backend

    assert _pick_backend("auto", torch.zeros(2, 2), (1, 2, 2), torch.float32, NSConfig()) == "torch"
    with pytest.raises(ValueError, match="form='plain' only"):
        newton_schulz(torch.randn(4, 8), backend="triton", form="gram")


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
