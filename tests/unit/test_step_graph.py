"""Muon(capture_after=N): the hot step captured whole in a CUDA graph (muonlab.optim.step_graph).

The options it needs are refused by name on any machine, and what a graph assumes of the step is
checked on the CPU: every steady step makes the same torch calls with the same arguments, skipped
or not, whatever the lr a scheduler put in its tensor. The capture itself (replays bit for bit the
eager steps, a new capture when a setting or a gradient's place changes, no host synchronisation
in a replayed step) is checked on CUDA only.
"""

import pytest
import torch
from torch.overrides import TorchFunctionMode

from muonlab import Muon

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
SHAPES = [(64, 32), (32, 64), (4, 16, 24), (48,)]


def _params(device):
    return [torch.nn.Parameter(torch.randn(s, generator=torch.Generator().manual_seed(i)).to(device))
            for i, s in enumerate(SHAPES)]


def _muon(params, **options):
    options = dict(dict(lr=0.02, adamw_lr=3e-3, nonfinite_decision="device"), **options)
    lr, adamw_lr = options.pop("lr"), options.pop("adamw_lr")
    return Muon([dict(params=params[:3], lr=lr), dict(params=params[3:], algorithm="adamw", lr=adamw_lr)],
                weight_decay=0.01, adamw_weight_decay=0.1, ns_backend="torch", **options)


@pytest.mark.parametrize("options, message", [
    (dict(capture_after=0), "capture_after must be None or an int >= 1"),
    (dict(capture_after=True), "capture_after must be None or an int >= 1"),
    (dict(capture_after="3"), "capture_after must be None or an int >= 1"),
    (dict(capture_after=2, nonfinite_decision="host"), 'capture_after needs nonfinite_decision="device"'),
    (dict(capture_after=2, nonfinite_decision="host", nonfinite="raise"), "reads a flag on the host"),
    (dict(capture_after=2, ns_graphs=True), "ns_graphs must be False"),
    (dict(capture_after=2, state_offload="cpu"), "state_offload='cpu'"),
    (dict(capture_after=2), r"needs CUDA parameters: parameter .*\(64, 32\).* is on cpu"),
])
def test_what_a_captured_step_needs_is_refused_by_name(options, message):
    with pytest.raises(ValueError, match=message):
        _muon(_params("cpu"), **options)


def test_without_capture_the_optimizer_has_no_graph_and_copies_keep_the_option():
    import copy

    opt = _muon(_params("cpu"))
    assert opt.capture_after is None and opt._step_graph is None
    opt.drop_captured_step()  # nothing to drop
    assert copy.deepcopy(opt).capture_after is None


# ---------------------------------------------------------------- CUDA


def _steps(opt, params, grads, steps, bad_at=(), change=None):
    """``steps`` steps with the gradients copied in place (where a captured step reads them);
    a NaN at the steps of ``bad_at``; ``change(step, opt)`` before a step. Returns per step the
    parameters and state, copied."""
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.9 ** s)
    for p in params:
        p.grad = torch.zeros_like(p)
    history = []
    for step in range(steps):
        if change is not None:
            change(step, opt)
        for p, g in zip(params, grads):
            p.grad.copy_(g * (1 + step))
        if step in bad_at:
            params[0].grad.view(-1)[3] = float("nan")
        opt.step()
        sched.step()
        history.append(([p.detach().clone() for p in params],
                         [{k: v.clone() for k, v in opt.state[p].items()} for p in params]))
    return history


def _same(a, b) -> bool:
    (pa, sa), (pb, sb) = a, b
    return all(torch.equal(x, y) for x, y in zip(pa, pb)) and all(
        x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(sa, sb))


def _pair(device="cuda", capture_after=2):
    """An eager optimizer and one capturing after ``capture_after`` steps, each on its copy of the
    same parameters, with tensor lrs (a scheduler fills them in place); and the gradients."""
    grads = [torch.randn(s, generator=torch.Generator().manual_seed(50 + i)).to(device) for i, s in enumerate(SHAPES)]
    runs = []
    for after in (None, capture_after):
        params = _params(device)
        lrs = dict(lr=torch.tensor(0.02, device=device), adamw_lr=torch.tensor(3e-3, device=device))
        runs.append((_muon(params, capture_after=after, **lrs), params))
    return runs, grads


@cuda
def test_replayed_steps_equal_eager_steps_bit_for_bit_and_skip_alike():
    runs, grads = _pair()
    (eager, eager_params), (captured, captured_params) = runs
    a = _steps(eager, eager_params, grads, 8, bad_at=(5,))
    b = _steps(captured, captured_params, grads, 8, bad_at=(5,))
    assert captured._step_graph.captured
    assert [_same(x, y) for x, y in zip(a, b)] == [True] * 8
    assert eager.skipped_steps == captured.skipped_steps == 1
    assert captured.last_step_stats()["skipped"] is False and captured.last_step_spans() == []
    captured.drop_captured_step()
    assert not captured._step_graph.captured


@cuda
def test_an_eager_step_on_request_records_spans_between_replays():
    runs, grads = _pair()  # captured at step 2, replayed at 3
    (eager, eager_params), (captured, captured_params) = runs
    seen = {}

    def change(step, opt):
        if step == 4:
            opt.trace_next_step()
        if step == 5:  # what step 4, eager on request, left
            seen.update(graph_kept=opt._step_graph.captured, spans=opt.last_step_spans(),
                        seconds=opt.last_step_stats()["seconds"])

    a = _steps(eager, eager_params, grads, 6)
    b = _steps(captured, captured_params, grads, 6, change=change)
    assert seen["graph_kept"], "the eager step dropped the graph"
    assert seen["spans"] and seen["seconds"]["newton_schulz"] > 0
    assert captured.last_step_spans() == []  # step 5 replayed
    assert [_same(x, y) for x, y in zip(a, b)] == [True] * 6


@cuda
def test_a_changed_setting_or_moved_gradients_capture_again_with_a_warning():
    runs, grads = _pair()
    (eager, eager_params), (captured, captured_params) = runs

    def change(step, opt):
        if step == 5:
            opt.param_groups[0]["weight_decay"] = 0.02

    a = _steps(eager, eager_params, grads, 9, change=change)
    with pytest.warns(RuntimeWarning, match="a setting changed"):
        b = _steps(captured, captured_params, grads, 9, change=change)
    assert [_same(x, y) for x, y in zip(a, b)] == [True] * 9
    for p in captured_params:
        p.grad = None  # new gradient tensors at the next step
    with pytest.warns(RuntimeWarning, match="a parameter or gradient moved"):
        _steps(captured, captured_params, grads, 1)


@cuda
def test_a_replayed_step_makes_no_host_synchronisation(cuda_sync_errors):
    runs, grads = _pair()
    captured, params = runs[1]
    _steps(captured, params, grads, 4)
    assert captured._step_graph.captured
    with cuda_sync_errors():
        captured.step()


# ---------------------------------------------------------------- what a CUDA graph assumes, checked on the CPU


class _Program(TorchFunctionMode):
    """Every torch call a block makes, as (function, its arguments described): tensors by shape,
    dtype and device, numbers and strings by value. A CUDA graph replays one such program with
    the values of its tensors changing; a step that makes another program (a branch taken on a
    host value) or passes other numbers (a value read on the host, baked at capture) can't be
    replayed."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.calls.append((getattr(func, "__qualname__", str(func)), _described(args),
                           _described(sorted(kwargs.items()))))
        return func(*args, **kwargs)


def _described(value):
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype, value.device.type)
    if isinstance(value, (list, tuple)):
        return tuple(_described(v) for v in value)
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device)):
        return value
    return type(value).__name__


def _programs(device_decision: bool, tensor_lr: bool, steps: int = 6, bad_at: int = 4, **options):
    """The program of each step after the first two, with a scheduler and a NaN at ``bad_at``."""
    params = _params("cpu")
    lrs = dict(lr=torch.tensor(0.02), adamw_lr=torch.tensor(3e-3)) if tensor_lr else dict(lr=0.02, adamw_lr=3e-3)
    opt = _muon(params, nonfinite_decision="device" if device_decision else "host", **lrs, **options)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.9 ** s)
    grads = [torch.randn(s, generator=torch.Generator().manual_seed(50 + i)) for i, s in enumerate(SHAPES)]
    for p in params:
        p.grad = torch.zeros_like(p)
    programs = []
    for step in range(steps):
        for p, g in zip(params, grads):
            p.grad.copy_(g * (1 + step))
        if step == bad_at:
            params[0].grad.view(-1)[3] = float("nan")
        with _Program() as program:
            opt.step()
        sched.step()
        if step >= 2:
            programs.append(program.calls)
    return programs


@pytest.mark.parametrize("options", [dict(), dict(update_rule="normuon", momentum_form="sum")])
def test_a_steady_step_on_the_device_is_one_program_whatever_its_values(options):
    """What capture_after relies on: with the skip decided on the device and a tensor lr, steps
    with other gradients, another lr from the scheduler and a skipped step make the same torch
    calls with the same arguments. The host decision (a skipped step runs nothing) and a float
    lr under a scheduler (each step passes another number) do not: made to fail here."""
    first, *others = _programs(device_decision=True, tensor_lr=True, **options)
    assert len(first) > 50 and all(calls == first for calls in others)
    host = _programs(device_decision=False, tensor_lr=True, **options)
    assert any(calls != host[0] for calls in host[1:])  # the skipped step at 4 ran nothing
    floats = _programs(device_decision=True, tensor_lr=False, **options)
    assert any(calls != floats[0] for calls in floats[1:])  # lr * ratio changed with the schedule


def test_a_capture_that_fails_says_why_once_and_the_steps_run_eagerly_after():
    """The failure path, on a machine where a CUDA graph can't even be made (no CUDA): the step
    that tries raises naming the cause, and later steps run eagerly instead of trying again."""
    from muonlab.optim.step_graph import StepGraph

    if torch.cuda.is_available():
        pytest.skip("a CUDA graph can be made here")
    graph, ran = StepGraph(after=1), []
    assert graph.mode(("k",), None) == "eager"
    graph.ran_eagerly()
    assert graph.mode(("k",), None) == "capture"
    with pytest.raises(RuntimeError, match="capture_after: the step could not be captured in a CUDA graph"):
        graph.capture(lambda: ran.append(1))
    assert graph.failed and not graph.captured
    assert graph.mode(("k",), None) == "eager"


def test_an_eager_step_asked_for_runs_once_and_keeps_the_graph():
    """trace_next_step's rule: the next step is eager whatever else holds, once; a graph is kept
    and a due capture waits a step. (A stand-in object marks a graph as captured: no CUDA here.)"""
    from muonlab.optim.step_graph import StepGraph

    graph = StepGraph(after=1)
    graph.mode(("k",), None)
    graph.ran_eagerly()
    graph.eager_next()
    assert graph.mode(("k",), None) == "eager"  # the capture, due, waits
    graph.ran_eagerly()
    assert graph.mode(("k",), None) == "capture"
    graph._graph = object()  # as if captured
    assert graph.mode(("k",), None) == "replay"
    graph.eager_next()
    assert [graph.mode(("k",), None) for _ in range(2)] == ["eager", "replay"]
    assert graph._graph is not None
    opt = _muon(_params("cpu"))  # without capture_after, asking changes nothing
    opt.trace_next_step()
    assert opt._step_graph is None
