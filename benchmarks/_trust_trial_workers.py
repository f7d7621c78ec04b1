"""Workers of bench_trust_trial.py (launched by muonlab.distributed.launch: they must live in a module).

* ``late_form``: DDP forgotten after the first step(s): a small GPT from one seed on every rank
  (equal weights), plain tensors under the default group (DDP's replicated layout, no wrapper),
  the same rows on every rank before step ``own_from``, each rank's own rows from it on, gradients
  never all-reduced. Which step raises, its error, and whether that step changed anything.
* ``pid_and_reduce``, ``raise_on_rank``, ``hang_mid_run``: the warm-pool and failure items.
* ``fsdp_runs``: a small MLP on FSDP2 against one process (on a group of this rank alone).
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from muonlab import Muon, muon_param_groups

# ---------------------------------------------------------------------------------- 1. forgot DDP, late form

GPT_CFG = dict(d_model=24, n_layers=2, n_heads=2, context=16)
GPT_HYPER = dict(lr=0.02, momentum=0.9, weight_decay=0.01, ns_dtype=torch.float32, comm_dtype=torch.float32)
ROWS = 2


def _gpt(precision: str):
    from muonlab.models import GPT, GPTConfig

    torch.manual_seed(0)  # one seed: equal weights on every rank
    model = GPT(GPTConfig(**GPT_CFG))
    return model.to(torch.bfloat16 if precision == "bf16" else torch.float32)


def _rank_batches(rank: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``rank``'s rows of deterministic global batches of 2 ranks x ROWS rows."""
    gen = torch.Generator().manual_seed(7)
    out = []
    for _ in range(steps):
        t = torch.randint(0, 256, (2 * ROWS, GPT_CFG["context"] + 1), generator=gen)[rank * ROWS:(rank + 1) * ROWS]
        out.append((t[:, :-1], t[:, 1:]))
    return out


def _snapshot(model, opt) -> dict:
    out = {("param", n): p.detach().clone() for n, p in model.named_parameters()}
    names = {p: n for n, p in model.named_parameters()}
    for p, state in opt.state.items():
        for key, value in state.items():
            out[(names[p], key)] = value.detach().clone() if torch.is_tensor(value) else value
    out["skipped_steps"] = opt.skipped_steps
    return out


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) if torch.is_tensor(a[k]) else a[k] == b[k] for k in a)


def late_form(precision: str, own_from: int, steps: int = 4) -> dict:
    torch.set_num_threads(1)
    model = _gpt(precision)
    opt = Muon(muon_param_groups(model), **GPT_HYPER)
    same, own = _rank_batches(0, steps), _rank_batches(dist.get_rank(), steps)
    for step in range(steps):
        x, y = (own if step >= own_from else same)[step]
        model(x, y).backward()
        snapshot = _snapshot(model, opt)
        t0 = time.perf_counter()
        try:
            opt.step()
        except Exception as err:  # noqa: BLE001 - the type is part of what is measured
            return dict(at=step, kind=type(err).__name__, error=str(err), seconds=time.perf_counter() - t0,
                        unchanged=_equal(snapshot, _snapshot(model, opt)),
                        momentum=sum("momentum_buffer" in s for s in opt.state.values()))
        opt.zero_grad()
    return dict(at=None, kind=None, error=None, seconds=None, unchanged=None, momentum=None)


def late_form_runs(cases) -> dict:
    return {case: late_form(*case) for case in cases}


# ---------------------------------------------------------------------------------- 5. launch failures


def pid_and_reduce() -> int:
    """This worker's pid, after an all_reduce that checks the group."""
    t = torch.ones(1)
    dist.all_reduce(t)
    assert int(t.item()) == dist.get_world_size()
    return os.getpid()


def raise_on_rank(rank: int, kind: str, out_dir: str) -> int:
    """``rank`` writes its wall time to ``out_dir/raised`` then raises ``kind`` (KeyboardInterrupt or
    RuntimeError); the other ranks sleep up to a minute outside any collective, so only the failing
    rank's own report can end the launch before then."""
    if dist.get_rank() == rank:
        with open(os.path.join(out_dir, "raised"), "w") as f:
            f.write(repr(time.time()))
        raise {"KeyboardInterrupt": KeyboardInterrupt, "RuntimeError": RuntimeError}[kind](f"deliberate {kind}")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        time.sleep(0.1)
    return dist.get_rank()


def hang_mid_run(hanging_rank: int, hang_at: int, step_s: float = 0.5) -> int:
    """A training loop (replicated Muon matrices, equal gradients on every rank, a Muon step per
    iteration in the default group, ``step_s`` of other work per step); at step ``hang_at`` rank
    ``hanging_rank`` stops for ever outside any collective while the others go on into the step's
    collectives and wait there."""
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(16, 16, generator=gen)) for _ in range(4)]
    opt = Muon(ps, lr=0.02, ns_dtype=torch.float32)
    for step in range(1000):
        if step == hang_at and dist.get_rank() == hanging_rank:
            while True:
                time.sleep(1)
        time.sleep(step_s)
        g = torch.Generator().manual_seed(100 + step)
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return dist.get_rank()


# ---------------------------------------------------------------------------------- 6. FSDP2 against one process

MLP_WIDTHS = (40, 40, 40, 10)
"""Weights (40, 40), (40, 40), (10, 40): the trial's small MLP."""
MLP_ROWS = 2
MLP_HYPER = dict(lr=0.02, weight_decay=0.01, momentum=0.95)
MLP_OPTIONS = {"defaults": {}, "fp32_wire": dict(comm_dtype=torch.float32), "bf16_wire": dict(comm_dtype=torch.bfloat16)}
MLP_CASES = (("rows", "defaults"), ("global", "defaults"), ("rows", "fp32_wire"), ("global", "bf16_wire"))
"""(gradients, options): "rows" is FSDP2's own backward on each rank's rows (the trial's run),
"global" the one-process gradient of the whole batch handed to each rank as its shard (the
optimizer's inputs exactly one process's); bf16_wire is the control that a coarser wire shows."""


def build_mlp() -> torch.nn.Sequential:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for d_in, d_out in zip(MLP_WIDTHS, MLP_WIDTHS[1:]):
        layers += [torch.nn.Linear(d_in, d_out), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def mlp_batches(world: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(7)
    rows = world * MLP_ROWS
    return [(torch.randn(rows, MLP_WIDTHS[0], generator=gen), torch.randn(rows, MLP_WIDTHS[-1], generator=gen))
            for _ in range(steps)]


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _one_process(world: int, steps: int, group) -> dict:
    model = build_mlp()
    opt = Muon(muon_param_groups(model), process_group=group, **MLP_HYPER)
    for x, y in mlp_batches(world, steps):
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _fsdp(grads: str, steps: int, **options) -> dict:
    from torch.distributed.tensor import distribute_tensor

    from muonlab.distributed import apply_fsdp, build_mesh

    world, rank = dist.get_world_size(), dist.get_rank()
    model = apply_fsdp(build_mlp(), build_mesh())
    opt = Muon(muon_param_groups(model), **MLP_HYPER, **options)
    twin = build_mlp()
    for x, y in mlp_batches(world, steps):
        if grads == "rows":
            rows = slice(rank * MLP_ROWS, (rank + 1) * MLP_ROWS)
            torch.nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        else:
            twin.load_state_dict({n: _full(p) for n, p in model.named_parameters()})
            torch.nn.functional.mse_loss(twin(x), y).backward()
            for (_, p), (_, q) in zip(model.named_parameters(), twin.named_parameters()):
                p.grad = distribute_tensor(q.grad, p.device_mesh, p.placements)
            twin.zero_grad()
        opt.step()
        opt.zero_grad()
    return dict(params={n: _full(p) for n, p in model.named_parameters()},
                choices=sorted({(tuple(c["shape"]), c["dtype"], c["wire_dtype"]) for c in opt.resolved_choices()}))


def fsdp_runs(steps: int = 3) -> dict:
    """One process (on a group of this rank alone, Muon's defaults) and every case of MLP_CASES."""
    from muonlab.kernels.newton_schulz import cpu_has_native_bf16

    torch.set_num_threads(1)
    world = dist.get_world_size()
    alone, _ = dist.new_subgroups(group_size=1)
    out: dict = {"one_process": _one_process(world, steps, alone), "native_bf16": cpu_has_native_bf16()}
    for grads, options in MLP_CASES:
        out[(grads, options)] = _fsdp(grads, steps, **MLP_OPTIONS[options])
    return out
