"""Workers for test_replicas.py: replicated (DDP) Muon matrices whose owner changes between
steps keep their momentum (it follows the owner), plan() called on one rank alone, or a
process group of one rank per model, runs no collective with the others, and a small GPT
trained on each rank's own data without DDP (refused at the first step, or at the step where the
ranks' data part ways), under DDP, or per rank in its own group."""

from __future__ import annotations

import torch
import torch.distributed as dist

from muonlab import Muon, muon_param_groups
from muonlab.optim.momentum_homes import MOMENTUM_MOVE

from ._common import DTYPES, SMALL_GPT, build_gpt, rank_rows, shifted, token_batches

SHAPES = {"big": (8, 8), "p1": (4, 4), "p2": (4, 4)}
STEPS = 4


def has_grad(name: str, step: int) -> bool:
    """'big' has no gradient at step 1 (on every rank alike): the owners are balanced over the
    other two, and p1 or p2 changes owner."""
    return not (name == "big" and step == 1)


def grads(step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return {n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}


def params(bf16: tuple[str, ...] = ()) -> dict[str, torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    return {n: torch.nn.Parameter(torch.randn(s, generator=gen).to(torch.bfloat16 if n in bf16 else torch.float32))
            for n, s in SHAPES.items()}


def train(consolidate_at: int | None = None, bf16: tuple[str, ...] = ()) -> dict:
    """STEPS steps of plain replicas (every rank the same values) under the world group, or in one
    process outside any group: the final parameters, where each momentum lives after each step,
    and the momentum bytes each step's stats count as moved (sent, received).
    ``consolidate_at``: after that step, consolidate_state() then each rank's momentum of p1/p2.
    ``bf16``: names of parameters kept in bf16 (p2: two dtypes of one shape)."""
    ps = params(bf16)
    opt = Muon([{"params": list(ps.items())}], lr=0.05, momentum=0.9, ns_dtype=torch.float32,
               comm_dtype=torch.float32)
    held, moved, consolidated = [], [], None
    for step in range(STEPS):
        g = grads(step)
        for n, p in ps.items():
            p.grad = g[n].to(p.dtype) if has_grad(n, step) else None
        opt.step()
        held.append({n: "momentum_buffer" in opt.state.get(p, {}) for n, p in ps.items()})
        stats = opt.last_step_stats()
        moved.append((stats["bytes_sent"].get(MOMENTUM_MOVE, 0), stats["bytes_recv"].get(MOMENTUM_MOVE, 0)))
        if step == consolidate_at:
            opt.consolidate_state()
            consolidated = {n: opt.state[ps[n]]["momentum_buffer"].clone() for n in ("p1", "p2")}
            opt.release_unowned_state()
    return dict(params={n: p.detach().clone() for n, p in ps.items()}, held=held, moved=moved,
                consolidated=consolidated)


def plan_on_one_rank() -> dict:
    """Rank 0 alone asks for the plan before the first step (it must not wait for the others),
    then every rank steps."""
    ps = params()
    opt = Muon([{"params": list(ps.items())}], lr=0.05, ns_dtype=torch.float32)
    names = None
    if dist.get_rank() == 0:
        names = sorted(n for b in opt.plan() for n in b.names)
    for n, p in ps.items():
        p.grad = grads(0)[n].clone()
    opt.step()
    return dict(names=names)


def one_model_per_rank() -> dict:
    """Each rank its own model (shapes differ between ranks) under a group of its own, and the set
    of parameters with a gradient changes on rank 0 only: no collective with the other rank."""
    me = dist.get_rank()
    alone = [dist.new_group([r]) for r in range(dist.get_world_size())][me]  # every rank enters every new_group
    ps = {"w": torch.nn.Parameter(torch.randn(6, 4 + me)), "v": torch.nn.Parameter(torch.randn(5, 3))}
    opt = Muon([{"params": list(ps.items())}], lr=0.05, ns_dtype=torch.float32, process_group=alone)
    for step in range(3):
        for n, p in ps.items():
            p.grad = None if (me == 0 and n == "v" and step == 1) else torch.randn_like(p)
        opt.step()
    return dict(steps=3)


def grad_laid_out_unlike_its_parameter(kind: str) -> dict:
    """A Shard(0) parameter (or a Replicate one, for "partial_on_replicate") whose gradient has
    other placements: the step must refuse it by name before anything changes."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    full = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
    placement = Replicate() if kind == "partial_on_replicate" else Shard(0)
    w = torch.nn.Parameter(distribute_tensor(full, mesh, [placement]))
    opt = Muon([{"params": [("w", w)]}], lr=0.05, ns_dtype=torch.float32)
    grad = torch.ones(6, 4)
    if kind == "replicate":
        w.grad = distribute_tensor(grad, mesh, [Replicate()])
    elif kind == "shard1":
        w.grad = distribute_tensor(grad, mesh, [Shard(1)])
    else:  # an unreduced gradient: each rank's share of a sum
        w.grad = DTensor.from_local(grad / dist.get_world_size(), mesh, [Partial()])
    before = w.detach().full_tensor()
    try:
        opt.step()
        error = None
    except ValueError as err:
        error = str(err)
    return dict(error=error, unchanged=torch.equal(before, w.detach().full_tensor()) and not opt.state.get(w))


def resume_from_each_ranks_state_dict(resume_after: int, init_first: bool = False, then: str | None = None) -> dict:
    """train() with each rank's own opt.state_dict() taken after step ``resume_after`` (owners
    have moved by then) and loaded into a new optimizer on new parameters, which go on training.
    ``init_first``: init_state() before the first step (zeros on every rank, as for a
    checkpoint load). ``then``: after the load, "consolidate" (consolidate_state() then
    release_unowned_state()) or "init" (init_state())."""
    ps = params()
    opt = Muon([{"params": list(ps.items())}], lr=0.05, momentum=0.9, ns_dtype=torch.float32,
               comm_dtype=torch.float32)
    if init_first:
        opt.init_state()
    for step in range(STEPS):
        g = grads(step)
        for n, p in ps.items():
            p.grad = g[n].clone() if has_grad(n, step) else None
        opt.step()
        if step == resume_after:
            saved = opt.state_dict()
            ps = {n: torch.nn.Parameter(p.detach().clone()) for n, p in ps.items()}
            opt = Muon([{"params": list(ps.items())}], lr=0.05, momentum=0.9, ns_dtype=torch.float32,
                       comm_dtype=torch.float32)
            opt.load_state_dict(saved)
            if then == "consolidate":
                opt.consolidate_state()
                opt.release_unowned_state()
            elif then == "init":
                opt.init_state()
    return dict(params={n: p.detach().clone() for n, p in ps.items()})


def release_alone_after_consolidate() -> dict:
    """consolidate_state() on every rank, then rank 0 releases alone before the others (as after
    a save of its own): no collective may be left in it."""
    ps = params()
    opt = Muon([{"params": list(ps.items())}], lr=0.05, ns_dtype=torch.float32)
    for step in range(2):
        for n, p in ps.items():
            p.grad = grads(step)[n].clone() if has_grad(n, step) else None
        opt.step()
    opt.consolidate_state()
    if dist.get_rank() == 0:
        opt.release_unowned_state()
    dist.barrier()
    if dist.get_rank() != 0:
        opt.release_unowned_state()
    return dict(held=sorted(n for n, p in ps.items() if "momentum_buffer" in opt.state.get(p, {})))


def switch_strategy(at: int) -> dict:
    """train() (no owner moves needed) with the strategy switched from "muonlab" (one owner per
    matrix) to "redundant" (every rank orthogonalizes every matrix) before step ``at``, and back
    two steps later."""
    ps = params()
    opt = Muon([{"params": list(ps.items())}], lr=0.05, momentum=0.9, ns_dtype=torch.float32,
               comm_dtype=torch.float32)
    for step in range(STEPS):
        if step in (at, at + 2):
            opt.strategy = "redundant" if step == at else "muonlab"
        g = grads(step)
        for n, p in ps.items():
            p.grad = g[n].clone() if has_grad(n, step) else None
        opt.step()
    return dict(params={n: p.detach().clone() for n, p in ps.items()})


# ---------------------------------------------------------------- replicas trained on different data

GPT_HYPER = dict(lr=0.02, momentum=0.9, weight_decay=0.01, ns_dtype=torch.float32, comm_dtype=torch.float32)
GPT_STEPS = 2


def _gpt(precision: str):
    return build_gpt(**SMALL_GPT).to(DTYPES[precision])  # one seed: equal weights on every rank


def rank_batches(rank: int, steps: int = GPT_STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``rank``'s rows of deterministic global batches: each rank's own data."""
    return [shifted(rank_rows(b, rank)) for b in token_batches(7, 2, SMALL_GPT["context"] + 1, steps)]


def _snapshot(model, opt) -> dict:
    """Every parameter and state value (AdamW's step counts included), and the skip count."""
    out = {("param", n): p.detach().clone() for n, p in model.named_parameters()}
    names = {p: n for n, p in model.named_parameters()}
    for p, state in opt.state.items():
        for key, value in state.items():
            out[(names[p], key)] = value.detach().clone() if torch.is_tensor(value) else value
    out["skipped_steps"] = opt.skipped_steps
    return out


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k]
                                        for k in a)


def forgot_ddp(precision: str, before: str | None = None) -> dict:
    """A small GPT from one seed on every rank (equal weights), each rank on its own rows, no DDP
    wrapper, the optimizer under the default group: a user who forgot DDP. ``before`` the step on
    different data, on the same rows everywhere (equal gradients: legitimate replicas):

    * "step": a step with the first Muon matrix frozen, so the different data arrives with a new
      plan and state already exists (momentum, AdamW step counts);
    * "nan": a step whose gradient of the first Muon matrix holds a NaN on the last rank only
      (skipped); the plan it made has its gradients compared by the next step;
    * "consolidate": consolidate_state() (no gradients yet), which makes the plan outside a step;
      the first step compares the gradients.

    Returns the error of the step and whether the parameters, the state and the skip count are as
    before it, with the Muon matrices' names and shapes."""
    torch.set_num_threads(1)
    model = _gpt(precision)
    opt = Muon(muon_param_groups(model), **GPT_HYPER)
    names = {p: n for n, p in model.named_parameters()}
    muon = {names[p]: tuple(p.shape) for g in opt.param_groups if g["algorithm"] == "muon" for p in g["params"]}
    first = next(p for p in names if names[p] in muon)
    if before in ("step", "nan"):
        x, y = rank_batches(0, 1)[0]
        model(x, y).backward()
        if before == "step":
            first.grad = None
        elif dist.get_rank() == dist.get_world_size() - 1:
            first.grad.view(-1)[0] = float("nan")
        opt.step()
        opt.zero_grad()
    elif before == "consolidate":
        opt.consolidate_state()
    x, y = rank_batches(dist.get_rank())[0]
    model(x, y).backward()
    snapshot = _snapshot(model, opt)
    try:
        opt.step()
        error = None
    except ValueError as err:
        error = str(err)
    return dict(error=error, unchanged=_equal(snapshot, _snapshot(model, opt)), muon=muon, state=len(opt.state),
                skipped=opt.skipped_steps)


def forgot_ddp_runs(cases) -> dict:
    """forgot_ddp for each (precision, before) in one launch (a refused step leaves the group usable)."""
    return {case: forgot_ddp(*case) for case in cases}


def late_form(precision: str, own_from: int, steps: int = 4) -> dict:
    """forgot_ddp's model and optimizer, the same rows on every rank (equal gradients: the plan's
    check passes) before step ``own_from``, each rank's own rows from it on: DDP forgotten after
    the first step. Returns the step that raised and its error, whether that step changed anything
    (parameters, momentum, AdamW state, skip count), and the Muon matrices' names and shapes."""
    torch.set_num_threads(1)
    model = _gpt(precision)
    opt = Muon(muon_param_groups(model), **GPT_HYPER)
    names = {p: n for n, p in model.named_parameters()}
    muon = {names[p]: tuple(p.shape) for g in opt.param_groups if g["algorithm"] == "muon" for p in g["params"]}
    same, own = rank_batches(0, steps), rank_batches(dist.get_rank(), steps)
    for step in range(steps):
        x, y = (own if step >= own_from else same)[step]
        model(x, y).backward()
        snapshot = _snapshot(model, opt)
        try:
            opt.step()
        except ValueError as err:
            return dict(at=step, error=str(err), unchanged=_equal(snapshot, _snapshot(model, opt)), muon=muon,
                        momentum=sum("momentum_buffer" in s for s in opt.state.values()))
        opt.zero_grad()
    return dict(at=None, error=None, unchanged=False, muon=muon, momentum=None)


def late_form_runs(cases) -> dict:
    """late_form for each (precision, own_from) in one launch."""
    return {case: late_form(*case) for case in cases}


def with_ddp(precision: str, steps: int = GPT_STEPS, nan_at: int | None = None, nonfinite: str = "skip") -> dict:
    """forgot_ddp's run under parallelize(model, "ddp"): all-reduced, bit-identical gradients pass
    the check. The parameters after ``steps`` steps, and the fingerprint each step's exchange
    carried. ``nan_at``: at that step the last rank's first Muon gradient holds a NaN after the
    all-reduce (its replicas' gradients differ there): the non-finite check's to skip (the error
    under ``nonfinite="raise"``, under "errors")."""
    from muonlab.distributed import parallelize

    torch.set_num_threads(1)
    model, inner, _ = parallelize(_gpt(precision), "ddp")
    opt = Muon(muon_param_groups(inner), nonfinite=nonfinite, **GPT_HYPER)
    first = next(p for g in opt.param_groups if g["algorithm"] == "muon" for p in g["params"])
    sent, errors = [], {}
    real = opt._agreement.check

    def spy(*args, **kwargs):
        sent.append(args[4])  # the fingerprint
        return real(*args, **kwargs)

    opt._agreement.check = spy
    for step, (x, y) in enumerate(rank_batches(dist.get_rank(), steps)):
        model(x, y).backward()
        if step == nan_at and dist.get_rank() == dist.get_world_size() - 1:
            first.grad.view(-1)[0] = float("nan")
        try:
            opt.step()
        except ValueError as err:
            errors[step] = str(err)
        opt.zero_grad()
    out = {n: p.detach().clone() for n, p in inner.named_parameters()}
    return dict(params=out, sent=sent, skipped=opt.skipped_steps, errors=errors)


def with_ddp_runs(precisions) -> dict:
    return {precision: with_ddp(precision)["params"] for precision in precisions}


def single_process_global(precision: str) -> dict:
    """with_ddp's reference: one process on both ranks' rows together."""
    model = _gpt(precision)
    opt = Muon(muon_param_groups(model), **GPT_HYPER)
    for (x0, y0), (x1, y1) in zip(rank_batches(0), rank_batches(1)):
        model(torch.cat([x0, x1]), torch.cat([y0, y1])).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def model_per_rank(alone: bool = False) -> dict:
    """forgot_ddp's run with process_group=dist.new_group([rank]) (``alone``: in one process, no
    group): each rank trains its own model on its own rows. The parameters after GPT_STEPS steps;
    in one process, those of rank 0's and rank 1's rows."""
    torch.set_num_threads(1)
    out = {}
    for rank in ((0, 1) if alone else (dist.get_rank(),)):
        group = None if alone else [dist.new_group([r]) for r in range(dist.get_world_size())][rank]
        model = _gpt("fp32")
        opt = Muon(muon_param_groups(model), process_group=group, **GPT_HYPER)
        for x, y in rank_batches(rank):
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
        out[rank] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out
