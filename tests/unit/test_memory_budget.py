"""The optimizer step's memory (muonlab.comm.memory): planned == counted in one process, the
``memory_budget`` refusal before anything changes, its bad values, and ``simulate``'s report."""

from __future__ import annotations

import re

import pytest
import torch

import muonlab
from muonlab.comm.memory import buffer_peaks, engine_order
from muonlab.comm.paths import PATHS
from muonlab.comm.paths.base import Itemsizes
from muonlab.models import GPT, GPTConfig
from muonlab.optim.planning import memory_of
from muonlab.simulate import simulate, step_memory


def _model_and_grads(seed: int = 0):
    torch.manual_seed(seed)
    model = GPT(GPTConfig(d_model=64, n_layers=2))
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    return model


def test_every_registered_path_has_a_buffer_formula():
    """A path the engine runs must say what it allocates (``CommPath.buffer_bytes``)."""
    missing = [name for name, p in PATHS.items() if p.run is not None and p.buffer_bytes is None]
    assert not missing, missing


@pytest.mark.parametrize("rule", ["muon", "normuon"])
def test_one_process_planned_equals_counted_and_the_workspace_within_its_bound(rule):
    model = _model_and_grads()
    opt = muonlab.Muon(muonlab.muon_param_groups(model, adamw_lr=3e-3), lr=0.02, update_rule=rule,
                       momentum_dtype=torch.bfloat16 if rule == "muon" else None)
    opt.step()
    stats, mem = opt.last_step_stats(), memory_of(opt)
    held = sum(t.nbytes for _, p in opt._muon_entries() for t in opt.state[p].values() if torch.is_tensor(t))
    assert mem.state == held > 0, (mem.state, held)  # momentum (bf16 or fp32), NorMuon's row moments
    assert (stats["buffer_peak_bytes"], stats["buffer_bytes"]) == (mem.ranks[0].peak, mem.ranks[0].by_batch) == (0, {})
    assert 0 < opt._runner.nbytes <= mem.workspace  # the arena the runner kept, within the planned bound
    assert [b.buffer_bytes for b in opt.plan()] == [(0,)] * len(opt.plan())  # local: views, results in place


def test_memory_budget_refuses_before_anything_changes_and_names_a_workspace_that_fits():
    model = _model_and_grads()
    opt = muonlab.Muon(muonlab.muon_param_groups(model, adamw_lr=3e-3), lr=0.02, memory_budget=5 << 20)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match="over memory_budget=5242880") as err:
        opt.step()
    msg = str(err.value)
    assert "batch 0 (local, 2 x (256, 64): blocks.0.mlp.fc.weight" in msg, msg  # the batch, by path, shape, names
    assert "needs 8388608 bytes on rank 0" in msg and "workspace 8388608 bytes" in msg, msg  # the peak
    fits = int(re.search(r"workspace_bytes=(\d+) fits", msg).group(1))
    assert fits == 4 << 20, msg
    # nothing changed: parameters, gradients, no state made, no step counted
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert all(torch.equal(p.grad, grads[n]) for n, p in model.named_parameters())
    assert len(opt.state) == 0
    assert memory_of(opt).peak(0) == 8 << 20 and opt.plan()  # inspecting the plan refuses nothing
    # the setting it names fits: the step runs and moves the parameters
    opt.workspace_bytes = fits
    opt.step()
    assert not all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_memory_budget_that_no_workspace_meets_says_so():
    model = _model_and_grads()
    opt = muonlab.Muon(muonlab.muon_param_groups(model, adamw_lr=3e-3), lr=0.02, memory_budget=1000)
    with pytest.raises(ValueError, match=r"no workspace_bytes down to 1048576 fits .*raise memory_budget"):
        opt.step()
    assert len(opt.state) == 0


def test_memory_budget_none_and_auto_on_cpu_do_not_refuse():
    for budget in (None, "auto"):
        model = _model_and_grads()
        opt = muonlab.Muon(muonlab.muon_param_groups(model, adamw_lr=3e-3), lr=0.02, memory_budget=budget)
        opt.step()


@pytest.mark.parametrize("bad, kind", [(-1, ValueError), (1.5e9, TypeError), ("1GB", TypeError), (True, TypeError)])
def test_bad_memory_budget_is_refused_by_name(bad, kind):
    model = _model_and_grads()
    with pytest.raises(kind, match="memory_budget"):
        muonlab.Muon(muonlab.muon_param_groups(model, adamw_lr=3e-3), memory_budget=bad)
    opt = muonlab.Muon(muonlab.muon_param_groups(model, adamw_lr=3e-3))
    with pytest.raises(kind, match="memory_budget"):
        opt.memory_budget = bad


def test_engine_order_keeps_at_most_three_batches_in_flight():
    """The replay follows execute_plan: batch i+1's way out is issued before batch i's
    Newton-Schulz, batch i-1 finishes after it."""
    plan = simulate([(f"m{i}", (2048, 2048 + i)) for i in range(4)], 4)  # large: no wave
    ops = engine_order(plan.batches)
    assert ops[:4] == [("start", 0), ("start", 1), ("compute", 0), ("start", 2)], ops
    live, most = set(), 0
    for op, k in ops:
        if op == "start":
            live.add(k)
        elif op == "finish":
            live.discard(k)
        most = max(most, len(live))
    assert most == 3


def test_simulate_reports_per_rank_peaks_with_the_plans_formulas():
    plan = simulate([(f"m{i}", (64, 48)) for i in range(6)], 4, workspace_bytes=1 << 20)
    mem = step_memory(plan, 4, workspace_bytes=1 << 20)
    assert all(b.path == "all_to_all" and b.buffer_bytes for b in plan)
    # each rank's batches sum to what buffer_peaks charges them; peaks within those sums
    for g, rank in enumerate(mem.ranks):
        assert rank.by_batch == {b.index: b.buffer_bytes[g] for b in plan if b.buffer_bytes[g]}
        assert 0 < rank.peak <= sum(rank.by_batch.values())
    assert mem.peak(0) == mem.ranks[0].peak + (1 << 20)
    assert [r["step_peak"] for r in mem.rows()] == [mem.peak(g) for g in range(4)]
    assert buffer_peaks(plan.batches, 4, lambda b: Itemsizes(4, 2, 2))[0].peak == mem.ranks[0].peak


def test_auto_budget_on_cuda_is_free_memory_plus_what_the_step_may_reuse(monkeypatch):
    """memory_budget="auto" on a CUDA device (its queries stood in for here): the driver's free
    bytes, plus the caching allocator's unused blocks and the workspace arena the plan counts."""
    from muonlab.kernels.runner import NewtonSchulzRunner
    from muonlab.optim.options import MuonOptions
    from muonlab.optim.planning import memory_budget

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1000, 5000))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 300)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 200)
    runner = NewtonSchulzRunner(1 << 20)
    runner.workspace.take(torch.device("cpu"), [((4, 4), torch.float32)])  # an arena of 256 bytes (aligned)
    cuda = torch.device("cuda", 0)
    assert runner.nbytes == 256 and memory_budget(MuonOptions(), cuda, None, runner) == 1000 + 100 + 256
    assert memory_budget(MuonOptions(), torch.device("cpu"), None, runner) is None
    assert memory_budget(MuonOptions(memory_budget=None), cuda, None, runner) is None
    assert memory_budget(MuonOptions(memory_budget=123), cuda, None, runner) == 123
