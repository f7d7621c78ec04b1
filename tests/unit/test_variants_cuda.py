"""The variants on a GPU against the same run on the CPU: NorMuon (its row scales added with
``addcmul_``, fp32 and bf16 parameters), per-head Newton-Schulz, and QK-clip's recording and clip.
Skipped without CUDA (benchmarks/gpu_checklist.sh tests runs it on a lent GPU)."""

from __future__ import annotations

import pytest
import torch

from muonlab import Muon, muon_param_groups
from muonlab.models import GPT, GPTConfig
from muonlab.optim.qk_clip import QKClip

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

CFG = dict(d_model=32, n_heads=4, n_layers=2, context=16)


def _train(device: str, dtype=torch.float32, steps=3, **options) -> dict[str, torch.Tensor]:
    """The GPT (q/k rows scaled up so its logits pass tau) after ``steps`` Muon steps on ``device``,
    fp32 Newton-Schulz; ``options``: Muon's, plus ``split_heads`` and ``qk_clip`` (tau)."""
    split, tau = options.pop("split_heads", False), options.pop("qk_clip", None)
    torch.manual_seed(0)
    model = GPT(GPTConfig(**CFG))
    with torch.no_grad():
        for b in model.blocks:
            b.attn.qkv.weight[: 2 * CFG["d_model"]].mul_(4.0)
    model = model.to(device=device, dtype=dtype)
    opt = Muon(muon_param_groups(model, split_heads=split), ns_dtype=torch.float32, lr=0.05, **options)
    clip = QKClip(model, tau=tau).attach(opt) if tau is not None else None
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randint(0, 256, (4, CFG["context"] + 1), generator=gen).to(device)
        model(x[:, :-1], x[:, 1:]).backward()
        opt.step()
        opt.zero_grad()
    out = {n: p.detach().float().cpu() for n, p in model.named_parameters()}
    if clip is not None:
        out["max_logit"] = torch.stack([torch.stack(s.max_logit) for s in clip.history]).float().cpu()
        out["clipped"] = torch.tensor([s.clipped_heads for s in clip.history])
    return out


def _close(got: dict, want: dict, tol: float) -> None:
    for n, w in want.items():
        g = got[n]
        if n == "clipped":
            assert torch.equal(g, w), (n, g, w)
            continue
        err = float((g - w).abs().max() / w.abs().max().clamp_min(1e-30))
        assert err <= tol, (n, err)


@pytest.mark.parametrize("options", [dict(update_rule="normuon"), dict(split_heads=True),
                                     dict(split_heads=True, update_rule="normuon"), dict(qk_clip=20.0)],
                         ids=["normuon", "split_heads", "split_heads_normuon", "qk_clip"])
def test_variant_on_cuda_equals_the_cpu_in_fp32(options):
    _close(_train("cuda", **dict(options)), _train("cpu", **dict(options)), 1e-4)


def test_normuon_with_bf16_parameters_on_cuda_stays_near_the_cpu():
    got = _train("cuda", torch.bfloat16, update_rule="normuon")
    assert all(torch.isfinite(t).all() for t in got.values())
    _close(got, _train("cpu", torch.bfloat16, update_rule="normuon"), 2e-2)
