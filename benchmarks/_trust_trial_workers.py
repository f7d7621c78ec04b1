"""Workers of bench_trust_trial.py (launched by muonlab.launch: they must live in a module).

* Item 1 (DDP forgotten after the first steps) launches the replicas tests' worker,
  ``tests.distributed._workers_replicas.late_form_runs``, as it is.
* ``pid_and_reduce``, ``raise_on_rank``, ``hang_mid_run``: the warm-pool and failure items.
* ``fsdp_runs``: the trial's small MLP on FSDP2 against one process, through the wire-dtype tests'
  worker (``tests.distributed._workers_wire.runs``, as ``bench_wire_parity.py`` runs it), plus
  whether muonlab sees native bf16 in the workers.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from muonlab import Muon

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
MLP_CASES = (("rows", "defaults"), ("global", "defaults"), ("rows", "fp32_wire"), ("global", "bf16_wire"))
"""(gradients, options of ``_workers_wire.OPTIONS``): "rows" is FSDP2's own backward on each rank's
rows (the trial's run), "global" the one-process gradient of the whole batch handed to each rank as
its shard (the optimizer's inputs exactly one process's); bf16_wire is the control that a coarser
wire shows."""


def fsdp_runs(steps: int = 3) -> dict:
    """``_workers_wire.runs`` on the trial's MLP at one thread (each case, and one process with each
    options' set on a group of this rank alone), and whether muonlab sees native bf16 here."""
    from muonlab.kernels.newton_schulz import cpu_has_native_bf16
    from tests.distributed._workers_wire import runs

    return dict(runs(1, MLP_CASES, MLP_WIDTHS, steps), native_bf16=cpu_has_native_bf16())
