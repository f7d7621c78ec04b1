"""A tensor lr (torch's capturable form) read on the device: it follows its scheduler as a float
lr does, the step reads nothing on the host, and a 16-bit update is not rounded again by it."""

import pytest
import torch

from muonlab import Muon
from muonlab.trace.host_reads import HostReads

SHAPES = [(16, 8), (8, 16), (4, 6, 8), (32,)]


def _params(dtype=torch.float32):
    return [torch.nn.Parameter(torch.randn(s, generator=torch.Generator().manual_seed(i)).to(dtype))
            for i, s in enumerate(SHAPES)]


def _muon(params, lr, adamw_lr, **options):
    return Muon([dict(params=params[:3], lr=lr), dict(params=params[3:], algorithm="adamw", lr=adamw_lr)],
                weight_decay=0.05, adamw_weight_decay=0.1, **options)


def _grads(params, step, dtype=torch.float32):
    for i, p in enumerate(params):
        p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(100 * step + i)).to(dtype)


def _run(lr, adamw_lr, steps=5, dtype=torch.float32, schedule=lambda s: 0.7 ** s, **options):
    params = _params(dtype)
    opt = _muon(params, lr, adamw_lr, **options)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    for step in range(steps):
        _grads(params, step, dtype)
        opt.step()
        sched.step()
    return params, opt


@pytest.mark.parametrize("decision", ["host", "device"])
def test_a_tensor_lr_follows_its_scheduler_as_a_float_lr_does(decision):
    floats, _ = _run(0.02, 3e-3, nonfinite_decision=decision)
    tensors, opt = _run(torch.tensor(0.02), torch.tensor(3e-3), nonfinite_decision=decision)
    constant, _ = _run(torch.tensor(0.02), torch.tensor(3e-3), schedule=lambda s: 1.0, nonfinite_decision=decision)
    for a, b, c in zip(floats, tensors, constant):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)  # fp32 arithmetic in another order
        assert not torch.allclose(b, c, rtol=1e-4, atol=0)  # the schedule acted
    assert isinstance(opt.param_groups[0]["lr"], torch.Tensor)  # filled in place, not replaced
    torch.testing.assert_close(opt.param_groups[0]["lr"], torch.tensor(0.02 * 0.7 ** 5))


def test_a_steady_step_with_a_tensor_lr_decided_on_the_device_reads_nothing_on_the_host():
    params = _params()
    opt = _muon(params, torch.tensor(0.02), torch.tensor(3e-3), nonfinite_decision="device")
    for step in range(3):
        _grads(params, step)
        with HostReads() as reads:
            opt.step()
        opt.param_groups[0]["lr"].fill_(0.02 / (step + 2))  # as a scheduler does, outside the step
    assert reads.calls == [], reads.report()
    float_params = _params()
    float_opt = _muon(float_params, 0.02, 3e-3, nonfinite_decision="device")
    for step in range(3):  # the same steps with float lrs: the fills above were read
        _grads(float_params, step)
        float_opt.step()
        float_opt.param_groups[0]["lr"] = 0.02 / (step + 2)
    for a, b in zip(float_params, params):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)


def test_16_bit_updates_are_scaled_by_a_tensor_lr_in_fp32():
    """bf16 Newton-Schulz outputs added to fp32 parameters: times a tensor lr in bf16 they would be
    rounded once more (2^-9 of the update); in fp32 the step matches a float lr's to fp32 rounding."""
    start = [p.detach().clone() for p in _params()]
    bf16 = dict(steps=2, ns_dtype=torch.bfloat16, momentum_dtype=torch.bfloat16)  # bf16 outputs
    floats, _ = _run(0.0123, 3e-3, **bf16)
    tensors, _ = _run(torch.tensor(0.0123), torch.tensor(3e-3), **bf16)
    for a, b, p0 in zip(floats[:3], tensors[:3], start):
        # two fp32 roundings of parameters near 1 apart at most (its ulp: 1.2e-7); a bf16 rounding
        # of an update near 4e-3 would be up to 8e-6
        torch.testing.assert_close(b.detach() - p0, a.detach() - p0, rtol=0, atol=4e-7)


def test_a_tensor_lr_on_another_device_is_refused_by_name_before_anything_changes():
    params = _params()
    opt = _muon(params, 0.02, 3e-3)
    before = [p.detach().clone() for p in params]
    opt.param_groups[1]["lr"] = torch.tensor(3e-3, device="meta")
    _grads(params, 0)
    with pytest.raises(ValueError, match=r"parameter group 1's tensor lr is on meta and its parameter .* on cpu"):
        opt.step()
    assert all(torch.equal(a, p) for a, p in zip(before, params))
