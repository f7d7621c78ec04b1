"""muonlab.optim.nonfinite: one fused check over many grads, names only for the culprits."""

import pytest
import torch

from muonlab.optim import nonfinite


def _grads(dtype, n=12):
    gen = torch.Generator().manual_seed(0)
    shapes = [(8, 16), (16, 8), (5, 7), (0, 4), (33,)]
    return [torch.randn(shapes[i % len(shapes)], generator=gen).to(dtype) for i in range(n)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bad", [float("inf"), float("nan"), float("-inf")])
def test_one_nonfinite_grad_among_many_is_found_and_named(dtype, bad):
    grads = _grads(dtype)
    grads[7].view(-1)[3] = bad
    before = [g.clone() for g in grads]
    assert nonfinite.found(grads)
    assert nonfinite.culprits(grads, lambda i: f"g{i}") == ["g7"]
    for a, b in zip(grads, before):  # rewritten as itself: values (and NaNs) unchanged
        assert torch.equal(a, b) or torch.equal(a.isnan(), b.isnan())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_finite_grads_pass_with_no_per_grad_work(dtype, monkeypatch):
    def isfinite(t):
        raise AssertionError("a per-grad isfinite on the common path")

    monkeypatch.setattr(torch, "isfinite", isfinite)

    grads = _grads(dtype) + [torch.full((3, 3), 3e38, dtype=torch.float32)]  # huge but finite
    assert not nonfinite.found(grads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bad", [float("inf"), float("nan"), float("-inf"), None])
def test_a_dtype_the_fused_check_does_not_take_is_checked_by_largest_magnitudes(dtype, bad, monkeypatch):
    """On a GPU torch's fused check has no bf16: such grads take one foreach reduction of their
    largest magnitudes (emulated here by telling the CPU's check it takes no dtype): the same
    answers, no grad written, no per-grad isfinite, empty grads and huge finite values passed."""
    def fused(*args):
        raise AssertionError("the fused check was called for a dtype it does not take")

    def isfinite(t):
        raise AssertionError("a per-grad isfinite")

    monkeypatch.setitem(nonfinite.FUSED_CHECK_DTYPES, "cpu", ())
    monkeypatch.setattr(torch, "_amp_foreach_non_finite_check_and_unscale_", fused)
    monkeypatch.setattr(torch, "isfinite", isfinite)
    grads = _grads(dtype) + [torch.full((3, 3), 3e38).to(dtype)]  # huge but finite
    if bad is not None:
        grads[7].view(-1)[3] = bad
    before = [g.clone() for g in grads]
    assert nonfinite.found(grads) == (bad is not None)
    assert all(torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
               for a, b in zip(grads, before))


def test_mixed_dtypes_and_views_that_cant_be_written():
    grads = _grads(torch.float32, 4) + _grads(torch.bfloat16, 4) + [torch.ones(1).expand(4, 4)]
    assert not nonfinite.found(grads)
    grads.append(torch.tensor(float("nan")).expand(2, 3))
    assert nonfinite.found(grads)
    assert nonfinite.culprits(grads) == ["grad 9 of shape (2, 3)"]


def test_no_grads():
    assert not nonfinite.found([]) and nonfinite.culprits([]) == []
