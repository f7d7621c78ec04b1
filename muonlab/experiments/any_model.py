"""Train a model of your own with Muon on several ranks, from a notebook cell, with no module of
your own: ``train_model`` is the worker, the model, loss and batches its arguments.

    import torch, torch.nn as nn
    from muonlab.launcher import launch
    from muonlab.experiments.any_model import train_model
    from muonlab.viz import plot_loss_curves, plot_timeline

    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
    x, y = torch.randn(1024, 32), torch.randint(0, 10, (1024,))
    out = launch(train_model, 2, model, "cross_entropy", (x, y), mode="fsdp", steps=20, batch_size=64)
    plot_loss_curves({"fsdp": out[0]["history"]})
    plot_timeline(out[0]["step_spans"], steps=3, choices=out[0]["ns_choices"], clock=out[0]["span_clock"])

Everything passed to a launch is pickled: an ``nn.Sequential`` of torch layers is, a class defined
in a notebook cell is not (pass an importable function that builds it instead). The batch source
follows :mod:`muonlab.train`'s (a dataset of tensors, a callable ``step -> batch``, an iterable of
batches) and gives the GLOBAL batch: every rank draws the same one and trains on its own equal slice
of the rows, so the run follows the one-process run on the same batches (``train``).
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule

from .. import runs
from .._base import check_whole
from ..distributed import build_mesh, parallelize
from ..distributed.device import rank_device
from ..optim import Muon, muon_param_groups
from ..trace import StepRecorder
from ..train import BatchSource, History, resolve_loss, rows_of
from .steps import distributed_steps, optimizer_report
from .train import STEPS_KEPT

__all__ = ["MODES", "global_slice", "train_model"]

MODES = ("fsdp", "hsdp", "ddp")
"""The modes ``train_model`` takes (``parallelize``'s, less "ep", which needs muonlab's MoE GPT)."""


def global_slice(batch, rank: int, world: int):
    """This rank's equal share of the rows of every tensor in ``batch`` (nested in tuples, lists,
    dicts). A ValueError, naming the sizes, where the rows do not split evenly."""
    if torch.is_tensor(batch):
        rows = batch.shape[0] if batch.dim() else 0
        if rows % world:
            raise ValueError(f"a global batch of {rows} rows does not split evenly over {world} ranks: give a batch "
                             f"size that is a multiple of {world}")
        share = rows // world
        return batch[rank * share:(rank + 1) * share]
    if isinstance(batch, dict):
        return {k: global_slice(v, rank, world) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(global_slice(v, rank, world) for v in batch)
    return batch


def _build(model, seed: int) -> nn.Module:
    """The model as given (the same pickled weights on every rank), or built by an importable
    function after seeding (the same weights on every rank)."""
    if isinstance(model, nn.Module):
        return model
    if callable(model):
        torch.manual_seed(seed)
        built = model()
        if isinstance(built, nn.Module):
            return built
        raise TypeError(f"the model function returned {type(built).__name__}, not an nn.Module")
    raise TypeError(f"model must be an nn.Module or an importable function returning one, got {type(model).__name__}")


def train_model(
    model,
    loss=None,
    batches=None,
    *,
    mode: str = "fsdp",
    steps: int = 10,
    batch_size: int | None = None,
    lr: float = 0.02,
    seed: int = 0,
    replicate: int | None = None,
    block_attr: str | None = None,
    muon_kwargs: dict | None = None,
    record: bool | str = True,
) -> dict:
    """Train ``model`` with Muon for ``steps`` steps under ``mode`` on every rank of the launch.

    ``model``: an nn.Module (pickled by the launch: the same weights on every rank) or an importable
    function building one (called after ``torch.manual_seed(seed)``). ``loss``: a function
    ``(output, target) -> loss``, a torch.nn.functional name ("cross_entropy", "mse_loss"), or None
    for a model that returns its loss. ``batches``: the global batch source (see the module
    docstring), sliced evenly over the ranks; ``batch_size`` rows a step for a dataset of tensors.
    ``mode``: "fsdp" (:func:`muonlab.distributed.parallelize` finds the blocks; ``block_attr``
    names them instead), "hsdp" (``replicate`` replica groups: ``build_mesh(replicate=...)``) or
    "ddp". The optimizer: ``Muon(muon_param_groups(model), lr=lr, **muon_kwargs)`` (e.g.
    ``muon_kwargs=dict(adamw_lr=3e-3, ns_dtype=torch.float32)``), as one process would build it.

    Returns a dict with: rank, world_size, mode, losses (this rank's loss on its slice per step),
    mean_losses (their mean over ranks: the global batch's loss), history (a History of the mean
    losses and step times, with ``ns_choices``, for ``plot_loss_curves``), step_seconds (the
    optimizer step's), units (the FSDP units ``parallelize`` sharded; [] under DDP), ns_choices
    (``Muon.resolved_choices()``), plan (``plan_rows``), plan_table, stats (``last_step_stats()``),
    spans: every rank's spans of the last step as dicts on rank 0 (``plot_timeline``), None on the
    other ranks, step_spans: the same for the last ``STEPS_KEPT`` steps, numbered
    (``muonlab.trace.StepRecorder``; ``plot_timeline(..., steps=k)``, ``trace.step_time``), and
    span_clock: "gpu" or "host" (what the spans time), record: the folder of the run record rank 0
    wrote (muonlab.runs; None on the other ranks).

    ``record``: True (default) has rank 0 keep a run record (configuration, seeds, provenance, the
    history, the plan table) in the launch's own folder ``runs/<launch name>/``, a string names a
    folder of its own under ``runs/``, False keeps none.

    A ValueError or TypeError naming the argument before any model is parallelized: ``mode`` not in
    ``MODES``, ``steps`` not a whole number >= 1, an unknown loss name, a batch source of another
    kind, ``replicate`` outside "hsdp" (or missing there), a global batch whose rows do not split
    evenly over the ranks (at the first step).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    check_whole("steps", steps, 1)
    runs.check_record_arg(record)
    if (replicate is None) == (mode == "hsdp"):
        raise ValueError("replicate (replica groups of build_mesh) is read in mode 'hsdp' only, and needed there; "
                         f"got replicate={replicate!r} with mode {mode!r}")
    if batches is None:
        raise ValueError("batches is needed: a dataset of tensors (x, y), a callable step -> batch or a list of batches")
    loss_fn = resolve_loss(loss)
    source = BatchSource(batches, batch_size=batch_size, generator=torch.Generator().manual_seed(seed))
    world, rank = dist.get_world_size(), dist.get_rank()
    device = rank_device()

    net = _build(model, seed)
    keep = record is not False and dist.get_rank() == 0
    described_model = runs.describe_model(net)  # before parallelize turns its parameters into shards
    initial, why = runs.snapshot(net) if keep else (None, "")  # what a rerun launches again
    mesh = build_mesh(replicate=replicate) if mode == "hsdp" else None
    net, inner, _ = parallelize(net, mode, mesh, block_attr=block_attr)
    units = [name for name, m in inner.named_modules() if name and isinstance(m, FSDPModule)]
    opt = Muon(muon_param_groups(inner), lr=lr, **(muon_kwargs or {}))
    recorder = StepRecorder(opt, keep=STEPS_KEPT, first_step=1)  # numbered as history.steps

    global_rows = []

    def my_share(step: int):
        batch = source.next_batch(step)
        global_rows.append(rows_of(batch))
        return global_slice(batch, rank, world)

    ran = distributed_steps(net, opt, my_share, range(1, steps + 1), loss_fn=loss_fn, device=device)
    history = History(steps=ran.steps, train_loss=list(ran.mean_losses), step_time_s=ran.step_seconds,
                      opt_time_s=list(ran.opt_seconds), tokens_per_step=global_rows[0])
    report = optimizer_report(opt, recorder)
    history.ns_choices = report["ns_choices"]
    plan_table = report["plan_table"]
    if keep:
        args = dict(mode=mode, steps=steps, batch_size=batch_size, lr=lr, seed=seed, replicate=replicate,
                    block_attr=block_attr, muon_kwargs=muon_kwargs or {}, world_size=world, units=units)
        batches_described, data = runs.describe_batches(batches, batch_size=batch_size)
        config = dict(train_model=runs.encode(args), model=described_model, optimizer=runs.describe_optimizer(opt),
                      loss_fn=runs.describe_loss(loss), batches=batches_described)
        if initial is None:
            config["initial_not_kept"] = why
        files = {k: v for k, v in dict(initial=initial, data=None if data is None else dict(batches=data)).items()
                 if v is not None}
        rec = runs.new_record("train_model", config=config, seeds=dict(model=seed, batches=seed), device=device,
                              history=history, plan_table=plan_table, files=files)
        folder = runs.launch_folder() if record is True else None
        try:
            history.record = runs.save(rec, folder or runs.claim_folder("train_model", None if record is True else
                                                                         record))
        except OSError as e:  # a full disk must not fail the run after its last step
            warnings.warn(f"train_model: the run record was not written ({e})", stacklevel=2)
    return dict(
        report, rank=rank, world_size=world, mode=mode, losses=ran.losses, mean_losses=list(ran.mean_losses),
        history=history, step_seconds=ran.opt_seconds, units=units, record=history.record,
    )
