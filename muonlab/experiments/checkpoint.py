"""Worker functions for saving, resharding and resuming a run (notebook 05, bench_checkpoint.py).

They live in an importable module because :func:`muonlab.launch` cannot start
functions defined in a notebook. Each builds the small GPT from seed 0, shards it with FSDP2 over
all ranks, trains with Muon on this rank's slice of a fixed global batch (so the global batch, and
the loss, do not depend on the world size) and returns plain data (tensors copied to the CPU,
so the caller needs no GPU to read them). ``build``, ``global_batch`` and ``train_steps`` are
shared with the fault demo (faults.py) and the checkpoint benchmark. The model and each batch sit
on this rank's device by muonlab's device rule (:mod:`muonlab.distributed.device`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .. import checkpoint
from .._base import check_whole
from ..distributed.device import rank_device, to_rank_device
from ..models import GPT, GPTConfig
from ..models.gpt import check_width
from ..optim import Muon, muon_param_groups
from .steps import distributed_steps
from .train import tensor_devices

__all__ = ["build", "global_batch", "train_steps", "train_and_save", "resume_and_train"]

GLOBAL_BATCH = 8
CONTEXT = 32
HEADS = 4
HYPER = dict(lr=0.02, weight_decay=0.01, momentum=0.9, adamw_lr=3e-3)


def _world_rank() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def build(width: int = 32, n_layers: int = 2):
    """(model, optimizer) on this rank's device: GPT from seed 0, FSDP2 over all ranks when distributed."""
    from ..distributed import parallelize

    check_width("width", width, HEADS)
    check_whole("n_layers", n_layers, 1)
    torch.manual_seed(0)  # on the CPU, so every rank and device starts from the same weights
    model = to_rank_device(GPT(GPTConfig(d_model=width, n_layers=n_layers, n_heads=HEADS, context=CONTEXT)))
    if dist.is_initialized():
        model, _, _ = parallelize(model, "fsdp")
    return model, Muon(muon_param_groups(model), **HYPER)


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of the global batch of ``step`` (random byte tokens)."""
    world, rank = _world_rank()
    if GLOBAL_BATCH % world:
        raise ValueError(f"the global batch of {GLOBAL_BATCH} does not split over {world} ranks")
    t = torch.randint(0, 256, (GLOBAL_BATCH, CONTEXT + 1), generator=torch.Generator().manual_seed(1000 + step))
    per = GLOBAL_BATCH // world
    t = t[rank * per:(rank + 1) * per].to(rank_device())
    return t[:, :-1], t[:, 1:]


def train_steps(model, opt, steps: range, *, done_before: int = 0, total: int | None = None) -> list[float]:
    """Train; return the global mean loss of each step.

    Each step is reported to the launcher (``report_progress``) as step ``done_before + i + 1`` of
    ``total`` (default: ``len(steps)``), so a launch that trains twice counts on across both."""
    return distributed_steps(model, opt, global_batch, steps, first_reported=done_before + 1,
                             total=total).mean_losses


def _full_params(model) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu().clone()
            for n, p in model.named_parameters()}


def train_and_save(path: str, steps: int, save_at: int, width: int = 32) -> dict:
    """A straight run of ``steps`` steps, and a run that saves at ``save_at``: losses, saved params,
    and where the saving run's tensors lived (``tensor_devices``). ``save_at`` is a step of the
    run, 0 (before the first) to ``steps`` (after the last)."""
    check_whole("steps", steps, 1)
    check_whole("save_at", save_at, 0)
    if save_at > steps:
        raise ValueError(f"save_at={save_at} is past the run's steps={steps}: save at a step from 0 to {steps}")
    model, opt = build(width)
    straight = train_steps(model, opt, range(steps), total=steps + save_at)
    model, opt = build(width)
    before = train_steps(model, opt, range(save_at), done_before=steps, total=steps + save_at)
    checkpoint.save(path, model, opt, save_at)
    return dict(straight=straight, before=before, saved_params=_full_params(model),
                devices=tensor_devices(model, opt))


def resume_and_train(path: str, steps: int, width: int = 32) -> dict:
    """Load ``path`` (saved on any world size), train to ``steps``: losses, loaded params, and where
    the resumed run's tensors lived (``tensor_devices``, after training). ``steps`` must be past the
    checkpoint's step (checked once it is loaded, before training)."""
    check_whole("steps", steps, 1)
    model, opt = build(width)
    step = checkpoint.load(path, model, opt)
    if steps <= step:
        raise ValueError(f"steps={steps} leaves nothing to train: the checkpoint {path!r} is at step {step}; "
                         f"pass steps > {step}")
    loaded = _full_params(model)
    after = train_steps(model, opt, range(step, steps))
    return dict(step=step, loaded_params=loaded, after=after, devices=tensor_devices(model, opt))
