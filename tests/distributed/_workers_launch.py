"""Worker functions for tests/distributed/test_launch.py, test_launch_lifecycle.py and test_mesh.py.

They live in an importable module because launch() runs them in spawned processes. Checks that
need several ranks run here and return plain data; the tests assert on it in the parent.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from muonlab.distributed import apply_ddp, apply_fsdp, build_mesh, mesh_axis_group

from ._common import build_gpt

# test_launch's start-up clock test makes the workers' import of this module (part of their
# start-up: it happens when they unpickle the function) take this long
_SLOW_IMPORT_S = float(os.environ.get("MUONLAB_TEST_SLOW_IMPORT_S", "0"))
if _SLOW_IMPORT_S and "LOCAL_RANK" in os.environ:
    time.sleep(_SLOW_IMPORT_S)


# ---------------------------------------------------------------------------------- launch


def rank_info(*args, **kwargs):
    """(rank, world size, sum of ranks by all_reduce, pid, args, kwargs, intra-op threads)."""
    total = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(total)
    return {
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "rank_sum": total.item(),
        "pid": os.getpid(),
        "args": args,
        "kwargs": kwargs,
        "num_threads": torch.get_num_threads(),
        "backend": dist.get_backend(),
    }


def environment_and_parent(names: list[str]) -> dict:
    """The variables ``names`` as this worker sees them (None: unset), its pid and its parent's."""
    return {"env": {name: os.environ.get(name) for name in names}, "pid": os.getpid(), "ppid": os.getppid()}


def raise_on_rank(failing_rank: int, message: str) -> int:
    if dist.get_rank() == failing_rank:
        raise ValueError(message)
    # The other ranks wait in a collective, as real code would; elastic ends them.
    dist.barrier()
    return dist.get_rank()


def hang_on_rank0(pid_dir: str) -> int:
    with open(os.path.join(pid_dir, f"rank{dist.get_rank()}.pid"), "w") as f:
        f.write(str(os.getpid()))
    if dist.get_rank() == 0:
        while True:
            time.sleep(1)
    return dist.get_rank()


def hang_on_rank(hanging_rank: int) -> int:
    """``hanging_rank`` sleeps for ever; the others return their rank at once (and wait in the
    launcher's teardown for the hanging one)."""
    if dist.get_rank() == hanging_rank:
        while True:
            time.sleep(1)
    return dist.get_rank()


class DeliberateStop(BaseException):
    """A BaseException of the caller's own (neither an Exception nor SystemExit)."""


def base_exception_on_rank(failing_rank: int, kind: str) -> int:
    """``failing_rank`` raises ``kind`` ("KeyboardInterrupt" or "DeliberateStop"), both
    BaseExceptions only; the other ranks wait in a barrier, as real code would."""
    if dist.get_rank() == failing_rank:
        raise {"KeyboardInterrupt": KeyboardInterrupt, "DeliberateStop": DeliberateStop}[kind](f"deliberate {kind}")
    dist.barrier()
    return dist.get_rank()


def hang_while_others_wait_in_a_collective(hanging_rank: int) -> int:
    """``hanging_rank`` sleeps for ever outside any collective; the others wait for it in a barrier.
    The barrier runs on a group of its own with a long collective timeout, so the launcher's clock,
    not gloo's, ends the wait (the default group's timeout, timeout_s, counts from the barrier's
    call and would race the launcher's, counted from when every rank was up)."""
    from datetime import timedelta

    group = dist.new_group(timeout=timedelta(seconds=600))
    if dist.get_rank() == hanging_rank:
        while True:
            time.sleep(1)
    dist.barrier(group=group)
    return dist.get_rank()


def exit_on_rank(exiting_rank: int, code, out_dir: str | None = None, linger_s: float = 0.0) -> int:
    """``sys.exit(code)`` on one rank after ``linger_s`` seconds; the others return their rank at
    once, without a collective. With ``out_dir``, each rank writes the wall time at which its
    process ends ("rank<r>.end", from atexit) and the exiting rank the time it exits ("exit_call")."""
    import atexit
    import sys

    rank = dist.get_rank()
    if out_dir is not None:
        atexit.register(_write_time, os.path.join(out_dir, f"rank{rank}.end"))
    if rank == exiting_rank:
        time.sleep(linger_s)
        if out_dir is not None:
            _write_time(os.path.join(out_dir, "exit_call"))
        sys.exit(code)
    return rank


def vanish_on_rank(vanishing_rank: int) -> int:
    """``os._exit(0)`` on one rank: its process ends with code 0 and no result, skipping every
    handler (elastic then waits for that result for ever); the others return their rank."""
    rank = dist.get_rank()
    if rank == vanishing_rank:
        os._exit(0)
    return rank


def start_child_then(action: str, out_dir: str) -> int:
    """Start a process of its own (as a worker may start a data-prep tool), write its pid to
    ``out_dir/child<rank>.pid``, then "return" (the rank), "raise" or "hang"."""
    import subprocess

    child = subprocess.Popen(["sleep", "600"])
    _write_text(os.path.join(out_dir, f"child{dist.get_rank()}.pid"), str(child.pid))
    if action == "raise":
        raise RuntimeError("deliberate failure after starting a child process")
    while action == "hang":
        time.sleep(1)
    return dist.get_rank()


def wait_for_file(path: str, limit_s: float = 150.0) -> int:
    """Write ``<path>.waiting``, then wait (at most ``limit_s``) until ``path`` exists; return the rank."""
    _write_text(path + ".waiting", str(os.getpid()))
    deadline = time.monotonic() + limit_s
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.1)
    return dist.get_rank()


def destroy_group_then_return() -> int:
    """End as torchrun scripts do: destroy the process group, then return the rank."""
    dist.barrier()
    rank = dist.get_rank()
    dist.destroy_process_group()
    return rank


def _write_text(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _write_time(path: str) -> None:
    _write_text(path, repr(time.time()))


# ---------------------------------------------------------------------------------- meshes


class TinyModel(nn.Module):
    """A model shaped like muonlab's GPT for sharding: tok_emb, blocks (ModuleList), lm_head."""

    def __init__(self, vocab: int = 8, dim: int = 4, num_blocks: int = 2, out_rows: int = 3):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, dim), nn.Tanh()) for _ in range(num_blocks)
        )
        self.lm_head = nn.Linear(dim, out_rows, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_emb(tokens)
        for block in self.blocks:
            x = x + block(x)
        return self.lm_head(x)


def _tokens(seed: int) -> torch.Tensor:
    return torch.randint(0, 8, (3, 5), generator=torch.Generator().manual_seed(seed))


def _reference_grads(out_rows: int, seeds: list[int]) -> dict[str, torch.Tensor]:
    """Single-process grads of the mean loss over the given per-rank batches."""
    torch.manual_seed(0)
    model = TinyModel(out_rows=out_rows)
    for seed in seeds:
        (model(_tokens(seed)).square().mean() / len(seeds)).backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def _placements(param) -> list[str]:
    return [repr(p) for p in param.placements]


def _error_text(call) -> str | None:
    try:
        call()
    except ValueError as e:
        return str(e)
    return None


def _fsdp_report(mesh, out_rows: int) -> dict:
    """Shard sizes, placements, and a forward/backward checked against a single process."""
    torch.manual_seed(0)
    model = apply_fsdp(TinyModel(out_rows=out_rows), mesh)
    head = model.lm_head.weight
    # Every rank feeds its own batch (seeded by its rank); FSDP averages the grads over the
    # mesh's ranks, so the reference averages over the same batches.
    model(_tokens(dist.get_rank())).square().mean().backward()
    expected = _reference_grads(out_rows, mesh.mesh.flatten().tolist())
    max_err = max(
        (p.grad.full_tensor() - expected[name]).abs().max().item()
        for name, p in model.named_parameters()
    )
    return {
        "is_dtensor": all(isinstance(p, DTensor) for p in model.parameters()),
        "grad_is_dtensor": all(isinstance(p.grad, DTensor) for p in model.parameters()),
        "head_placements": _placements(head),
        "grad_placements": _placements(head.grad),
        "head_local_shape": tuple(head.to_local().shape),
        "head_global_shape": tuple(head.shape),
        "max_grad_err": max_err,
    }


def _ddp_report(group, group_ranks: list[int]) -> dict:
    torch.manual_seed(0)
    model = apply_ddp(TinyModel(out_rows=3), group)
    model(_tokens(dist.get_rank())).square().mean().backward()
    expected = _reference_grads(3, group_ranks)
    return {
        "type": type(model).__name__,
        "max_grad_err": max(
            (p.grad - expected[name.removeprefix("module.")]).abs().max().item()
            for name, p in model.named_parameters()
        ),
    }


def _gpt_report(mesh, tie_embeddings: bool) -> dict:
    """muonlab's GPT under apply_fsdp: grads match one process on the same per-rank batches."""
    cfg = dict(vocab_size=32, context=8, d_model=16, n_layers=2, n_heads=2, tie_embeddings=tie_embeddings)

    def batch(seed: int):
        idx = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(seed))
        return idx, idx.roll(-1, dims=1)

    ranks = mesh.mesh.flatten().tolist()
    reference = build_gpt(**cfg)
    for seed in ranks:
        (reference(*batch(seed)) / len(ranks)).backward()
    model = apply_fsdp(build_gpt(**cfg), mesh)
    model(*batch(dist.get_rank())).backward()
    expected = {name: p.grad for name, p in reference.named_parameters()}
    return {
        "is_dtensor": all(isinstance(p, DTensor) for p in model.parameters()),
        "max_grad_err": max(
            (p.grad.full_tensor() - expected[name]).abs().max().item()
            for name, p in model.named_parameters()
        ),
    }


def mesh_checks() -> dict:
    """All checks of meshes, FSDP, HSDP and DDP, on 4 ranks in one launch.

    2-rank cases run on the 2-rank "shard" sub-mesh (ranks {0, 1} and {2, 3}).
    """
    report = {"rank_info": rank_info()}
    mesh = build_mesh()
    report["mesh1d"] = (tuple(mesh.mesh_dim_names), tuple(mesh.shape), mesh.device_type)
    report["dp_group_size"] = dist.get_world_size(mesh_axis_group(mesh, "dp"))
    report["missing_axis"] = _error_text(lambda: mesh_axis_group(mesh, "tp"))

    mesh2d = build_mesh(replicate=2, shard=2)
    report["mesh2d"] = (tuple(mesh2d.mesh_dim_names), tuple(mesh2d.shape))
    report["mesh2d_inferred"] = tuple(build_mesh(replicate=2).shape)
    shard_group = mesh_axis_group(mesh2d, "shard")
    replicate_group = mesh_axis_group(mesh2d, "replicate")
    rank_t = torch.tensor([float(dist.get_rank())])
    shard_sum = rank_t.clone()
    dist.all_reduce(shard_sum, group=shard_group)
    replicate_sum = rank_t.clone()
    dist.all_reduce(replicate_sum, group=replicate_group)
    report["shard_sum"] = shard_sum.item()
    report["replicate_sum"] = replicate_sum.item()

    report["bad_dp"] = _error_text(lambda: build_mesh(3))
    report["bad_2d"] = _error_text(lambda: build_mesh(replicate=3, shard=2))
    report["bad_replicate"] = _error_text(lambda: build_mesh(replicate=3))
    report["bad_both"] = _error_text(lambda: build_mesh(4, replicate=2, shard=2))

    report["fsdp_6_rows_4_ranks"] = _fsdp_report(mesh, out_rows=6)
    report["fsdp_3_rows_2_ranks"] = _fsdp_report(mesh2d["shard"], out_rows=3)
    report["hsdp_6_rows"] = _fsdp_report(mesh2d, out_rows=6)
    report["ddp_4_ranks"] = _ddp_report(None, list(range(4)))
    report["ddp_2_ranks"] = _ddp_report(shard_group, mesh2d["shard"].mesh.tolist())
    report["gpt_fsdp_tied"] = _gpt_report(mesh, tie_embeddings=True)
    report["gpt_hsdp"] = _gpt_report(mesh2d, tie_embeddings=False)
    return report


# ---------------------------------------------------------------------------------- progress


def report_steps(num_steps: int, fail_rank: int | None = None) -> int:
    """Reports ``num_steps`` steps with loss ``10 * rank + step`` and prints a line to stdout and
    stderr; ``fail_rank`` raises after its first step."""
    import sys

    from muonlab.launcher import report_progress

    rank = dist.get_rank()
    print(f"stdout line from rank {rank}", flush=True)
    print(f"stderr line from rank {rank}", file=sys.stderr, flush=True)
    for step in range(1, num_steps + 1):
        report_progress(step=step, loss=torch.tensor(10.0 * rank + step), total=num_steps)
        if rank == fail_rank:
            raise RuntimeError(f"deliberate failure on rank {rank} after step {step}")
    return rank
