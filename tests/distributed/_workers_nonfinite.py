"""Workers for test_nonfinite_distributed.py: muonlab.optim.nonfinite on DTensor grads with the
flags shared by the step's control exchange, and Muon's step with the check on (skip, raise, and
bit-identical to the check off otherwise)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from muonlab import Muon
from muonlab.optim import nonfinite
from muonlab.optim.agreement import Agreement

from muonlab.comm.specs import local_shard

from ._common import full
from ._memory import memory_check


def _flagged(grads, group, name_of=None) -> tuple[list[int], list[str]]:
    """(ranks with a non-finite grad, as the control exchange shares them; this rank's culprits)."""
    found = nonfinite.found(grads)
    ranks = Agreement().check(group, 7, found, lambda: [])
    return ranks, nonfinite.culprits(grads, name_of) if found else []


def check_dtensor_grads():
    """DTensor grads (Shard(0), uneven and empty shards, fp32 and bf16): the last rank plants a
    non-finite value in one grad's shard; every rank learns the rank, only that rank the name."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.set_num_threads(1)
    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,))
    shapes = [(10, 4), (2, 3), (world * 2 + 1, 5), (7, 7)]
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        fulls = [torch.randn(s, generator=torch.Generator().manual_seed(i)).to(dtype) for i, s in enumerate(shapes)]
        grads = [distribute_tensor(f, mesh, [Shard(0)]) for f in fulls]
        names = [f"g{i}" for i in range(len(grads))]
        out[f"clean_{dtype}"] = _flagged(grads, dist.group.WORLD, names.__getitem__)
        if rank == world - 1:
            grads[2].to_local().view(-1)[-1] = float("nan")
        out[f"nan_{dtype}"] = _flagged(grads, dist.group.WORLD, names.__getitem__)
    # a subgroup of the first and last ranks: ranks come back as global ranks
    sub = dist.new_group([0, world - 1])
    if rank in (0, world - 1):
        g = torch.ones(3)
        if rank == world - 1:
            g[1] = float("-inf")
        out["subgroup"] = _flagged([g], sub)
    return out


# ---------------------------------------------------------------- Muon's step with the check

SHAPES = [(8, 16), (8, 16), (8, 16), (16, 8), (16, 8), (12, 12), (5, 7), (4, 6, 8)]
"""Several same-shape batches (a multi-batch plan), rows that don't divide by 2 (uneven shards),
and a bank of 4 matrices (whole matrices on each rank: a path without a way out or back)."""
HYPER = dict(lr=0.02, weight_decay=0.01, momentum=0.9, adamw_weight_decay=0.01)


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    return init_device_mesh("cpu", (dist.get_world_size(),))


def _params(mesh, bank: bool = True) -> list[tuple[str, torch.nn.Parameter]]:
    """FSDP2-style Shard(0) DTensor parameters (the matrices of SHAPES), one replicated plain
    matrix (DDP-style: its owner rank orthogonalizes it, then broadcasts) and one AdamW vector, last."""
    from torch.distributed.tensor import Shard, distribute_tensor

    def init(i, shape):
        return torch.randn(shape, generator=torch.Generator().manual_seed(i))

    out = [(f"w{i}", torch.nn.Parameter(distribute_tensor(init(i, s), mesh, [Shard(0)])))
           for i, s in enumerate(SHAPES) if bank or len(s) == 2]
    out.append(("replicated", torch.nn.Parameter(init(50, (10, 6)))))
    out.append(("bias", torch.nn.Parameter(distribute_tensor(init(51, (16,)), mesh, [Shard(0)]))))
    return out


def _muon(params, **kwargs) -> Muon:
    return Muon([{"params": params[:-1]}, {"params": params[-1:], "algorithm": "adamw"}], **HYPER, **kwargs)


def _set_grads(params, mesh, step: int, bad: str | None = None) -> None:
    """The same global grads on every rank (seeded by step); ``bad``: the last rank plants a NaN
    in that parameter's shard of its grad."""
    from torch.distributed.tensor import Shard, distribute_tensor

    for i, (name, p) in enumerate(params):
        full_grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(100 * step + i))
        p.grad = distribute_tensor(full_grad, mesh, [Shard(0)]) if hasattr(p, "to_local") else full_grad
        if name == bad and dist.get_rank() == dist.get_world_size() - 1:
            local_shard(p.grad).view(-1)[0] = float("nan")


def _snapshot(params, opt) -> dict:
    """Every parameter and state tensor in full (a collective: the same order on every rank)."""
    out = {name: full(p) for name, p in params}
    for name, p in params:
        for key, value in opt.state.get(p, {}).items():  # .get: looking must not create state
            out[(name, key)] = full(value) if torch.is_tensor(value) else value
    return out


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def check_on_and_off_are_bit_identical() -> dict:
    """With the check on ("skip": flags in the control exchange) and off ("ignore"), every
    momentum form, bf16 momentum of fp32 parameters, the redundant strategy (paths without a way
    back) and a bank in parts, from fresh state on: after each step, parameters and state are equal
    bit for bit."""
    mesh = _mesh()
    out = {}
    cases = [dict(momentum_form=form, nesterov=nesterov) for form in ("ema", "sum") for nesterov in (True, False)]
    cases.append(dict(momentum_dtype=torch.bfloat16))
    cases.append(dict(strategy="redundant"))  # every batch gathered whole: no way back
    cases.append(dict(workspace_bytes=1))  # the bank in parts of one matrix per rank
    for k, case in enumerate(cases):
        runs = {policy: _params(mesh) for policy in ("skip", "ignore")}
        opts = {policy: _muon(runs[policy], nonfinite=policy, **case) for policy in runs}
        equal = []
        for step in range(3):
            for policy in runs:
                _set_grads(runs[policy], mesh, step)
                opts[policy].step()
            equal.append(_equal(_snapshot(runs["skip"], opts["skip"]), _snapshot(runs["ignore"], opts["ignore"])))
        out[k] = equal
        out[f"paths{k}"] = [b.path for b in opts["skip"].plan()]
        out[f"memory{k}"] = memory_check(opts["skip"])  # gather_all (redundant), parts, bf16 momentum
    return out


def skipped_steps_leave_no_trace(state_offload: str | None = None, bank: bool = True,
                                 workspace_bytes: int | None = None) -> dict:
    """A NaN on the last rank only, in the first step (no state yet), in a parameter of the plan's
    first batch, of its last batch, and in the AdamW vector: every rank skips each of them with
    parameters and state unchanged, and the run ends equal to one that never saw them."""
    from muonlab.comm import engine

    events = []  # per step: batches started and the check, in order
    start_batch, check = engine.BatchRun.start, nonfinite.found

    def started_batch(run):
        events[-1].append(run.index)
        start_batch(run)

    def checked(*args, **kwargs):
        events[-1].append("check")
        return check(*args, **kwargs)

    engine.BatchRun.start, nonfinite.found = started_batch, checked
    mesh = _mesh()
    ref_params, params = _params(mesh, bank), _params(mesh, bank)
    ref = _muon(ref_params, state_offload=state_offload, workspace_bytes=workspace_bytes)
    opt = _muon(params, state_offload=state_offload, workspace_bytes=workspace_bytes)
    plan = opt.plan()
    first, last = plan[0].names[0], plan[-1].names[-1]
    out = dict(first=first, last=last, skips=[], paths=[b.path for b in plan], parts=[b.part for b in plan])
    good = iter(range(4))
    for bad in (first, None, first, None, last, "bias", None):
        before = _snapshot(params, opt)
        step = 90 if bad else next(good)
        _set_grads(params, mesh, step, bad)
        events.append([])
        opt.step()
        if bad:
            out.setdefault("order", []).append(events[-1])
            stats = opt.last_step_stats()
            comm = [s for s in opt.last_step_spans() if s.name in ("comm_out", "comm_back")]
            out["skips"].append(dict(unchanged=_equal(before, _snapshot(params, opt)), skipped=stats["skipped"],
                                     ranks=stats["nonfinite_ranks"], names=stats["nonfinite_params"],
                                     state=len(opt.state), comm_spans=len(comm),
                                     stats_bytes=(sum(stats["bytes_sent"].values()),
                                                  sum(stats["bytes_recv"].values()))))
        else:
            _set_grads(ref_params, mesh, step)
            ref.step()
    out["skipped_steps"] = opt.skipped_steps
    engine.BatchRun.start, nonfinite.found = start_batch, check
    out["equal_to_clean_run"] = _equal(_snapshot(params, opt), _snapshot(ref_params, ref))
    return out


def raise_changes_nothing() -> dict:
    """nonfinite="raise" with a NaN on the last rank, first in a step with no state yet, then in a
    parameter of the first batch: every rank raises naming the rank (the last rank also the
    parameter) before anything changes, and the next steps run on, equal to a run without them."""
    mesh = _mesh()
    ref_params, params = _params(mesh), _params(mesh)
    ref, opt = _muon(ref_params, nonfinite="raise"), _muon(params, nonfinite="raise")
    first = opt.plan()[0].names[0]
    out = dict(first=first, raised=[])
    good = iter(range(3))
    for bad in (first, None, first, None, None):
        before = _snapshot(params, opt)
        step = 90 if bad else next(good)
        _set_grads(params, mesh, step, bad)
        try:
            opt.step()
        except ValueError as e:
            out["raised"].append(dict(message=str(e), unchanged=_equal(before, _snapshot(params, opt)),
                                      state=len(opt.state)))
        else:
            _set_grads(ref_params, mesh, step)
            ref.step()
    out["equal_to_clean_run"] = _equal(_snapshot(params, opt), _snapshot(ref_params, ref))
    return out


def device_decision_matches_host(case: dict) -> dict:
    """nonfinite_decision="device" against "host" on the same grads, NaNs on the last rank at steps
    0 (no state yet), 2 (a Muon matrix) and 4 (the AdamW vector): after every step parameters
    and state are equal bit for bit, both skip the same steps with the same stats, and a steady
    step under "device" reads nothing on the host but the agreement's own gloo digests (with
    ``case["tensor_lr"]`` every group's lr a tensor, in both runs). (A skipped
    first step leaves the device decision's state made and zero, which the host never made.)"""
    from muonlab.trace.host_reads import HostReads

    mesh = _mesh()
    case = dict(case)
    tensor_lr = case.pop("tensor_lr", False)
    runs = {decision: _params(mesh) for decision in ("host", "device")}
    opts = {decision: _muon(runs[decision], nonfinite_decision=decision, **case) for decision in runs}
    if tensor_lr:  # both runs: the ranks' digests agree on a tensor lr, which the step reads on the device
        for opt in opts.values():
            for group in opt.param_groups:
                group["lr"] = torch.tensor(float(group["lr"]))
    first = opts["host"].plan()[0].names[0]
    bad_at = {0: first, 2: first, 4: "bias"}
    out = dict(equal=[], stats=[], reads=None)
    for step in range(6):
        for decision, params in runs.items():
            _set_grads(params, mesh, step, bad_at.get(step))
            if decision == "device" and step == 5:
                with HostReads(allow=("optim/agreement.py",)) as reads:
                    opts[decision].step()
                out["reads"] = reads.report()
            else:
                opts[decision].step()
        host, device = _snapshot(runs["host"], opts["host"]), _snapshot(runs["device"], opts["device"])
        # a skipped first step: the host made no state, the device its fresh zeros (the same next step)
        fresh = all(not torch.is_tensor(device[k]) or not device[k].any() for k in device.keys() - host.keys())
        out["equal"].append(fresh and _equal(host, {k: device[k] for k in host}))
        out["stats"].append({d: {k: opts[d].last_step_stats().get(k, "absent") for k in
                                 ("skipped", "nonfinite_ranks", "nonfinite_params", "skipped_steps")} for d in opts})
    out["skipped_steps"] = {d: opts[d].skipped_steps for d in opts}
    return out
