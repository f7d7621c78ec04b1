"""The step program (muonlab.optim.step_program): per batch, the momentum and the update take a
number of Python calls that does not grow with the batch's matrices, and what it holds between
steps (each matrix's lr ratio, the state dicts) follows the settings and the state it was made from."""

import copy
import sys

import pytest
import torch

from muonlab import Muon


def _opt(k: int, **kwargs):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(24, 8)) for _ in range(k)]
    # one batch: a workspace that holds every matrix
    opt = Muon([{"params": params[: k // 2], "lr": 0.02}, {"params": params[k // 2:], "lr": 0.01}],
               ns_dtype=torch.float32, workspace_bytes=1 << 26, **kwargs)
    return params, opt


def _grads(params, seed):
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)


def _stage_calls(k: int) -> dict[str, int]:
    """Python calls of the program's two stages of one steady step, one batch of ``k`` matrices
    in two parameter groups."""
    params, opt = _opt(k)
    for step in range(2):
        _grads(params, step)
        opt.step()
    program = opt._prepared.program[1]
    assert len(program.batches) == 1 and len(program.batches[0].params) == k
    counts = {}

    def counted(name, real):
        def run(*args):
            calls = 0

            def profile(frame, event, arg):
                nonlocal calls
                calls += event == "call"
            sys.setprofile(profile)
            try:
                return real(*args)
            finally:
                sys.setprofile(None)
                counts[name] = calls
        return run

    program.prepare = counted("prepare", program.prepare)
    program.apply = counted("apply", program.apply)
    _grads(params, 2)
    opt.step()
    return counts


def test_a_batch_takes_as_many_calls_whatever_its_matrices():
    """The same calls for 4 and 16 matrices: no helper called per matrix, and no state looked up
    while the state table is unchanged (a lookup hashes a tensor, a Python call)."""
    small, large = _stage_calls(4), _stage_calls(16)
    assert small.keys() == {"prepare", "apply"}
    assert small == large, (small, large)


@pytest.mark.parametrize("mode", ["match_rms_adamw", None])
def test_adjust_lr_changed_between_steps_is_applied(mode):
    """The program holds each matrix's lr ratio: a new adjust_lr makes a new prepared step, so a
    step after the change equals a copy's (which prepares anew) bit for bit."""
    params, opt = _opt(4)
    _grads(params, 0)
    opt.step()
    twin = copy.deepcopy(opt)
    twin_params = [p for g in twin.param_groups for p in g["params"]]
    for o in (opt, twin):
        o.param_groups[0]["adjust_lr"] = mode
    _grads(params, 1)
    _grads(twin_params, 1)
    before = [p.detach().clone() for p in params]
    opt.step()
    twin.step()
    assert all(torch.equal(a, b) for a, b in zip(params, twin_params))
    assert not torch.equal(params[0], before[0])


def test_momentum_state_dropped_or_loaded_between_steps_is_read_anew():
    """Momentum buffers are read per step: a dropped one is made again (zeros), a loaded state
    dict's are the ones updated."""
    params, opt = _opt(4)
    for step in range(2):
        _grads(params, step)
        opt.step()
    saved = copy.deepcopy(opt.state_dict())
    del opt.state[params[1]]
    _grads(params, 2)
    opt.step()
    assert torch.equal(opt.state[params[1]]["momentum_buffer"], params[1].grad * (1 - 0.95))
    opt.load_state_dict(saved)
    loaded = opt.state[params[0]]["momentum_buffer"]
    expected = torch.lerp(loaded.clone(), params[0].grad, 1 - 0.95)
    opt.step()
    assert opt.state[params[0]]["momentum_buffer"] is loaded and torch.equal(loaded, expected)


def test_a_state_dict_replaced_between_steps_is_the_one_updated():
    """The program keeps each batch's state dicts while ``opt.state`` is unchanged
    (muonlab.optim.state_table): a parameter's dict replaced, or the table replaced, is read anew."""
    params, opt = _opt(4)
    for step in range(2):
        _grads(params, step)
        opt.step()
    fresh = {"momentum_buffer": torch.ones_like(params[2])}
    opt.state[params[2]] = fresh
    _grads(params, 2)
    expected = torch.lerp(torch.ones_like(params[2]), params[2].grad, 1 - 0.95)
    opt.step()
    assert opt.state[params[2]] is fresh and torch.equal(fresh["momentum_buffer"], expected)
    opt.state = dict(opt.state)  # a plain dict given back: kept as a table
    assert type(opt.state).__name__ == "StateTable"
    twin = copy.deepcopy(opt)
    assert type(twin.state).__name__ == "StateTable" and len(twin.state) == len(opt.state)
