"""Workers of the wire-dtype tests: a small MLP on FSDP2 with Muon's defaults against one process.

Two rows per rank, so each weight's gradient has rank at most 2 W: its momentum is low-rank, the
case where a wire coarser than the Newton-Schulz iterates shows (the rounding's noise fills the
near-null directions, which the iteration lifts towards 1). The widths give two kinds of batch on
a CPU with native bf16: (96, 40) and (40, 96) resolve to bf16 there ("auto" above
``CPU_FP32_MAX_WORK``), (40, 40) and (10, 40) to fp32; on a CPU without it, all to fp32.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from muonlab import Muon, muon_param_groups

from ._common import cloned, full, world_rank

WIDTHS = (40, 96, 40, 40, 40, 10)
"""Features in and out of each Linear: weights (96, 40), (40, 96), (40, 40), (40, 40), (10, 40)."""
ROWS_PER_RANK = 2
HYPER = dict(lr=0.02, weight_decay=0.01, momentum=0.95)
STEPS = 4
OPTIONS = {"defaults": {}, "bf16_wire": dict(comm_dtype=torch.bfloat16), "fp32_wire": dict(comm_dtype=torch.float32),
           "fp32_ns": dict(ns_dtype=torch.float32),
           "fp32_ns_bf16_wire": dict(ns_dtype=torch.float32, comm_dtype=torch.bfloat16)}
"""Muon's defaults, fp32 Newton-Schulz with the default wire, and each of them with
``comm_dtype=torch.bfloat16`` (the default until 2026-11-29), or fp32 on the wire."""
CASES = (("global", "defaults"), ("global", "bf16_wire"), ("rows", "fp32_ns"), ("rows", "fp32_ns_bf16_wire"))
"""(gradients, options) run on FSDP2 (gradients: see ``_fsdp_run``)."""


def build_mlp(widths=WIDTHS) -> torch.nn.Sequential:
    """Linear layers of these widths with ReLUs between, initialised from seed 0."""
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for d_in, d_out in zip(widths, widths[1:]):
        layers += [torch.nn.Linear(d_in, d_out), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers[:-1])


def batches(world: int, widths=WIDTHS, steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Global (inputs, targets) per step, ROWS_PER_RANK rows per rank, from a generator seeded 7."""
    gen = torch.Generator().manual_seed(7)
    rows = world * ROWS_PER_RANK
    return [(torch.randn(rows, widths[0], generator=gen), torch.randn(rows, widths[-1], generator=gen))
            for _ in range(steps)]


def _train(model, opt, data) -> None:
    for x, y in data:
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def single_process(world: int, widths=WIDTHS, steps: int = STEPS, **options) -> dict[str, torch.Tensor]:
    """The reference: one process, the whole global batch of each step."""
    model = build_mlp(widths)
    _train(model, Muon(muon_param_groups(model), **HYPER, **options), batches(world, widths, steps))
    return cloned(model.named_parameters())


def _fsdp_run(grads: str, widths=WIDTHS, steps: int = STEPS, **options) -> dict:
    """Muon (``options`` on top of its defaults) on the MLP sharded by FSDP2 over every rank.
    ``grads``: "rows" (FSDP2's backward, each rank on its ROWS_PER_RANK rows: the gradients
    differ from one process's by the rounding of their reduction) or "global" (the one-process
    gradient of the whole batch, from the gathered weights, as each rank's shard: the optimizer's
    inputs equal one process's exactly)."""
    from torch.distributed.tensor import distribute_tensor

    from muonlab.distributed import apply_fsdp, build_mesh

    world, rank = world_rank()
    model = apply_fsdp(build_mlp(widths), build_mesh())
    opt = Muon(muon_param_groups(model), **HYPER, **options)
    twin = build_mlp(widths)  # unsharded: the whole batch's gradient at the sharded model's weights
    for x, y in batches(world, widths, steps):
        if grads == "rows":
            rows = slice(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK)
            torch.nn.functional.mse_loss(model(x[rows]), y[rows]).backward()
        else:
            twin.load_state_dict({n: full(p) for n, p in model.named_parameters()})
            torch.nn.functional.mse_loss(twin(x), y).backward()
            for (_, p), (_, q) in zip(model.named_parameters(), twin.named_parameters()):
                p.grad = distribute_tensor(q.grad, p.device_mesh, p.placements)
            twin.zero_grad()
        opt.step()
        opt.zero_grad()
    plan = opt.plan()
    return dict(params={n: full(p) for n, p in model.named_parameters()},
                plan=[(b.matrix_shape, b.path, b.comm_itemsize, b.total_bytes) for b in plan],
                choices=[(c["shape"], c["dtype"], c["wire_dtype"]) for c in opt.resolved_choices()],
                sent=sum(opt.last_step_stats()["bytes_sent"].values()),
                plan_sent=sum(b.bytes_sent[rank] for b in plan))


def runs(threads: int = 1, cases=CASES, widths=WIDTHS, steps: int = STEPS) -> dict:
    """Every case of ``cases``, and the one-process reference of each options' set, run here on a
    group of this rank alone; all with ``threads`` intra-op threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        world, _ = world_rank()
        alone, _ = dist.new_subgroups(group_size=1)
        out = {options: single_process(world, widths, steps, process_group=alone, **OPTIONS[options])
               for options in {options for _, options in cases}}
        out.update({(grads, options): _fsdp_run(grads, widths, steps, **OPTIONS[options]) for grads, options in cases})
        return out
    finally:
        torch.set_num_threads(before)
