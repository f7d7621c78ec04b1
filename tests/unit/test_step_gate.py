"""nonfinite_decision="device" (muonlab.optim.step_gate) on one process: the same bits as the host
decision, skips that leave everything as it was, no host read in the step, and its errors."""

import copy
import pickle

import pytest
import torch

from muonlab import Muon
from muonlab.trace.host_reads import HostReads

SHAPES = [(16, 8), (8, 16), (12, 12), (4, 6, 8), (32,)]  # tall, wide, square, a bank; an AdamW vector
BAD = {0: (0, float("nan")), 3: (3, float("nan")), 4: (4, float("inf"))}
"""step -> (parameter, value planted in its grad): a first step with no state, a bank, the AdamW vector."""


def _params(dtype):
    return [torch.nn.Parameter(torch.randn(s, generator=torch.Generator().manual_seed(i)).to(dtype))
            for i, s in enumerate(SHAPES)]


def _muon(params, **options):
    return Muon([dict(params=params[:4]), dict(params=params[4:], algorithm="adamw")], lr=0.02,
                weight_decay=0.01, adamw_weight_decay=0.1, **options)


def _set_grads(params, step, dtype):
    for i, p in enumerate(params):
        p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(100 * step + i)).to(dtype)
    if step in BAD:
        i, value = BAD[step]
        params[i].grad.view(-1)[0] = value


def _state(opt, params):
    return [{k: v.clone() for k, v in opt.state[p].items()} for p in params if p in opt.state]


def _same(a, b) -> bool:
    return len(a) == len(b) and all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
                                    for x, y in zip(a, b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", [
    dict(),
    dict(momentum_form="sum"),
    dict(momentum_form="sum", nesterov=False),
    dict(update_rule="normuon"),
    dict(momentum_dtype=torch.bfloat16),
    dict(state_offload="cpu"),
    dict(state_offload="disk"),
], ids=["ema", "sum", "sum-plain", "normuon", "bf16-momentum", "offload-cpu", "offload-disk"])
def test_the_device_decision_writes_the_host_decisions_bits_and_skips_alike(case, dtype, tmp_path):
    runs = {}
    for decision in ("host", "device"):
        options = dict(case, offload_dir=tmp_path / decision) if case.get("state_offload") == "disk" else case
        params = _params(dtype)
        opt = _muon(params, nonfinite_decision=decision, **options)
        history = []
        for step in range(6):
            before = [p.detach().clone() for p in params], _state(opt, params)
            _set_grads(params, step, dtype)
            opt.step()
            stats = opt.last_step_stats()
            after = [p.detach().clone() for p in params], _state(opt, params)
            history.append((after, stats["skipped"], stats.get("nonfinite_ranks"), stats.get("nonfinite_params")))
            if step in BAD and step > 0:  # a skipped step (the first: its state is made, zero, under "device")
                assert all(torch.equal(x, y) for x, y in zip(before[0], after[0])), (decision, step)
                assert _same(before[1], after[1]), (decision, step)
        runs[decision] = history, opt.skipped_steps
    (host, host_skips), (device, device_skips) = runs["host"], runs["device"]
    assert host_skips == device_skips == len(BAD)
    for step, (h, d) in enumerate(zip(host, device)):
        assert all(torch.equal(x, y) for x, y in zip(h[0][0], d[0][0])), step
        if step > 0:
            assert _same(h[0][1], d[0][1]), step
        assert h[1:] == d[1:], step  # skipped, ranks, names


def test_a_skipped_first_step_leaves_fresh_state_only():
    params = _params(torch.float32)
    opt = _muon(params, nonfinite_decision="device")
    _set_grads(params, 0, torch.float32)
    opt.step()
    assert opt.skipped_steps == 1 and opt.last_step_stats()["skipped"]
    for p in params:
        for key, value in opt.state[p].items():
            assert not value.any(), key


@pytest.mark.parametrize("rule", ["muon", "normuon"])
def test_a_steady_step_decided_on_the_device_reads_nothing_on_the_host(rule):
    """What torch.cuda.set_sync_debug_mode("error") checks on a GPU (tests/unit/
    test_step_host_sync_cuda.py), checked here on the CPU: the host decision reads its flag (and
    AdamW's step count), the device decision reads nothing."""
    reads = {}
    for decision in ("host", "device"):
        params = _params(torch.float32)
        opt = _muon(params, nonfinite_decision=decision, update_rule=rule)
        for step in range(3):
            _set_grads(params, step + 10, torch.float32)
            with HostReads() as seen:
                opt.step()
        reads[decision] = seen.calls
    assert not reads["device"], reads["device"]
    assert any("optim/nonfinite.py" in where for _, where in reads["host"]), reads["host"]


def test_host_reads_sees_the_reads_a_gpu_would_wait_for():
    x = torch.ones(3)
    with HostReads(allow=("test_never_matches",)) as seen:
        x.sum().item()
        bool(x.any())
        x.tolist()
        torch.nonzero(x)
        y = x * 2  # device work only
    assert [name for name, _ in seen.calls] == ["item", "__bool__", "tolist", "nonzero"], seen.calls
    assert all("test_step_gate.py" in where for _, where in seen.calls)
    with HostReads(allow=("test_step_gate.py",)) as allowed:
        y.sum().item()
    assert allowed.calls == []


def test_skipped_steps_and_stats_are_read_when_asked_and_survive_copies():
    params = _params(torch.float32)
    opt = _muon(params, nonfinite_decision="device")
    for step in (0, 1, 3):
        _set_grads(params, step, torch.float32)
        opt.step()
    assert opt.skipped_steps == 2
    twin = copy.deepcopy(opt)
    assert twin.skipped_steps == 2 and twin.nonfinite_decision == "device"
    assert pickle.loads(pickle.dumps(opt)).skipped_steps == 2
    counted = opt._skips_on_device
    opt.skipped_steps = 7  # as a checkpoint's metadata sets it
    assert opt.skipped_steps == 7
    _set_grads(params, 3, torch.float32)
    opt.step()
    assert opt.skipped_steps == 8
    # the device's count stays the same tensor, zeroed in place: a captured step adds to it
    assert opt._skips_on_device is counted and int(counted) == 1
    stats = opt.last_step_stats()
    assert stats["skipped"] and stats["nonfinite_ranks"] == [0] and stats["skipped_steps"] == 8
    assert len(stats["nonfinite_params"]) == 1 and "(4, 6, 8)" in stats["nonfinite_params"][0]
    opt.zero_grad()  # the grads released: the culprits can't be named any more
    _set_grads(params, 3, torch.float32)
    opt.step()
    opt.zero_grad()
    assert opt.last_step_stats()["nonfinite_params"] is None


def test_bad_decisions_are_refused_by_name():
    params = _params(torch.float32)
    with pytest.raises(ValueError, match="unknown nonfinite_decision 'gpu'"):
        _muon(params, nonfinite_decision="gpu")
    with pytest.raises(ValueError, match='nonfinite_decision="device" .* needs nonfinite="skip"'):
        _muon(params, nonfinite_decision="device", nonfinite="raise")
