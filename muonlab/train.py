"""The small training loop behind the demo, the notebooks and the benchmarks.

By default ``train`` and ``compare_optimizers`` train muonlab's GPT on the corpus; any model trains
with a loss function and a batch source of its own::

    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
    opt = Muon(muon_param_groups(model), lr=0.02)
    hist = train(model, opt, steps=100, loss_fn="cross_entropy", batches=(x, y), batch_size=32)

A batch source (``batches``, ``val_batches``) is one of: a tuple of tensors with one leading size
(a dataset: each step draws ``batch_size`` rows at random, from a generator seeded with ``seed``);
a callable ``step -> batch`` (steps count from 1); any other iterable of batches (a DataLoader, a
list), started again when it runs out (a one-shot iterator that runs out is an error). A batch is
``(inputs, target)`` for ``loss_fn(model(inputs), target)``; without ``loss_fn`` the model computes
its own loss from the whole batch (``model(*batch)``, ``model(**batch)`` for a dict; an output with
a ``.loss``, as Hugging Face models return, gives that).
"""

from __future__ import annotations

import copy
import statistics
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

from . import runs
from .bars import in_notebook_kernel, notebook_bar
from .data import get_batch, load_corpus
from .distributed.device import rank_device, wait_for
from .models import GPT, GPTConfig
from .optim import Muon, muon_param_groups
from .optim.qk_clip import QKClip, check_tau
from .trace.spectral import SpectralRecord, SpectralRecorder


@dataclass
class History:
    """What one training run measured."""

    steps: list[int] = field(default_factory=list)
    train_loss: list[float] = field(default_factory=list)
    val_steps: list[int] = field(default_factory=list)
    val_loss: list[float] = field(default_factory=list)
    step_time_s: list[float] = field(default_factory=list)
    """Wall time of the whole training step (forward, backward, optimizer)."""
    opt_time_s: list[float] = field(default_factory=list)
    """Wall time of optimizer.step() alone."""
    tokens_per_step: int = 0
    """Tokens per step on the corpus; rows (samples) of a batch of your own."""
    spectral: list[SpectralRecord] = field(default_factory=list)
    """Spectral records of the matrices every ``spectral_every`` steps (muonlab.trace.spectral)."""
    ns_choices: list[dict] = field(default_factory=list)
    """What Newton-Schulz ran per plan batch (``Muon.resolved_choices()``: names, shape, path,
    dtype, form, backend) after the last step; empty for an optimizer that is not muonlab's Muon."""
    max_logit: list[torch.Tensor] = field(default_factory=list)
    """With ``qk_clip``: per step, (layers, heads) max attention logit of the step's forward, before
    the clip (muonlab.optim.qk_clip; NaN pads a layer with fewer heads)."""
    qk_clipped: list[int] = field(default_factory=list)
    """With ``qk_clip``: per step, the attention heads QK-clip scaled."""
    qk_overshoot: list[float] = field(default_factory=list)
    """With ``qk_clip``: per step, the step's max logit over tau (``QKClipStep.overshoot``): above
    1 after a clip, the previous update's growth, which the clip does not bound; 0.0 at tau = inf."""
    record: str | None = None
    """The folder of this run's record (muonlab.runs), None when none was written."""

    @property
    def tokens_per_s(self) -> float:
        total = sum(self.step_time_s)
        return self.tokens_per_step * len(self.step_time_s) / total if total else 0.0

    @property
    def opt_step_ms(self) -> float:
        """The median optimizer step in ms, over the steps after the first when there are several:
        the first allocates the optimizer state (and an upper median of two steps would be it)."""
        times = self.opt_time_s[1:] if len(self.opt_time_s) > 1 else self.opt_time_s
        return 1e3 * statistics.median(times) if times else 0.0

    def summary(self) -> dict:
        return dict(
            final_train_loss=self.train_loss[-1] if self.train_loss else float("nan"),
            final_val_loss=self.val_loss[-1] if self.val_loss else float("nan"),
            tokens_per_s=self.tokens_per_s,
            opt_step_ms=self.opt_step_ms,
        )


def default_device() -> torch.device:
    """This process's device by muonlab's device rule: in a worker, its rank's; alone, cuda:0 when
    CUDA is available, else the CPU ($MUONLAB_DEVICE=cpu keeps it on the CPU)."""
    return rank_device()


OPTIMIZERS = ("muon", "adamw")


def make_optimizer(name: str, model: torch.nn.Module, *, lr: float | None = None,
                   adamw_lr: float = 3e-3, weight_decay: float = 0.0, **kwargs):
    """"muon": Muon on hidden matrices + AdamW on the rest; "adamw": torch.optim.AdamW on all,
    betas (0.9, 0.95) unless given. The other keywords go to muonlab.Muon or torch.optim.AdamW,
    which refuse what they don't take (ns_steps for AdamW, say)."""
    if name == "muon":
        groups = muon_param_groups(model, adamw_lr=adamw_lr)
        return Muon(groups, lr=0.02 if lr is None else lr, weight_decay=weight_decay, **kwargs)
    if name == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=adamw_lr if lr is None else lr,
                                 weight_decay=weight_decay, **{"betas": (0.9, 0.95), **kwargs})
    raise ValueError(f"unknown optimizer {name!r}; choose one of {OPTIMIZERS}")


# ---------------------------------------------------------------------------------- any model


def resolve_loss(loss) -> Callable | None:
    """A loss function ``(output, target) -> loss``: ``loss`` itself, or the torch.nn.functional
    function it names ("cross_entropy", "mse_loss", ...); None stays None (the model's own loss)."""
    if loss is None or (callable(loss) and not isinstance(loss, str)):
        return loss
    if isinstance(loss, str):
        fn = getattr(F, loss, None)
        if loss.startswith("_") or not callable(fn) or isinstance(fn, type):
            raise ValueError(f"unknown loss {loss!r}: name a torch.nn.functional function, e.g. 'cross_entropy', "
                             f"'mse_loss', 'l1_loss', or pass a function (output, target) -> loss")
        return fn
    raise TypeError(f"loss_fn must be a function (output, target) -> loss or the name of a torch.nn.functional "
                    f"one, got {type(loss).__name__}")


def model_loss(model: torch.nn.Module, batch, loss_fn: Callable | None) -> torch.Tensor:
    """The loss of ``batch``: ``loss_fn(model(inputs), target)`` for a batch ``(inputs, target)``;
    without ``loss_fn``, the model's own: ``model(*batch)`` (``model(**batch)`` for a dict,
    ``model(batch)`` for a tensor), or that output's ``.loss``. Raises TypeError, saying what to
    pass, for a batch that is not a pair and for an output that is not one number."""
    if loss_fn is not None:
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            raise TypeError(f"a batch for loss_fn must be a pair (inputs, target), got "
                            f"{_describe(batch)}; or leave loss_fn out for a model that computes its own loss")
        inputs, target = batch
        loss = loss_fn(model(inputs), target)
    else:
        if isinstance(batch, Mapping):
            loss = model(**batch)
        elif isinstance(batch, (tuple, list)):
            loss = model(*batch)
        else:
            loss = model(batch)
        loss = getattr(loss, "loss", loss)
    if not (torch.is_tensor(loss) and loss.numel() == 1):
        raise TypeError(f"the loss must be one number, got {_describe(loss)}: pass loss_fn= (a function "
                        f"(output, target) -> loss, or a name such as 'cross_entropy') for a model that returns "
                        f"its output")
    return loss.reshape(())


def _describe(value) -> str:
    if torch.is_tensor(value):
        return f"a tensor of shape {tuple(value.shape)}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}: ({', '.join(_describe(v) for v in value)})"
    return type(value).__name__


def to_device(batch, device):
    """``batch`` with every tensor in it (nested in tuples, lists, dicts) on ``device``."""
    if torch.is_tensor(batch):
        return batch.to(device)
    if isinstance(batch, Mapping):
        return {k: to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(v, device) for v in batch)
    return batch


def rows_of(batch) -> int:
    """The leading size of the first tensor in ``batch`` (its rows, samples); 0 if it holds none."""
    if torch.is_tensor(batch):
        return batch.shape[0] if batch.dim() else 1
    values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (tuple, list)) else ()
    return next((n for n in (rows_of(v) for v in values) if n), 0)


def is_dataset(source) -> bool:
    """A tuple of tensors with one leading size: rows to draw batches from."""
    return (isinstance(source, tuple) and len(source) > 0 and all(torch.is_tensor(t) and t.dim() for t in source)
            and len({t.shape[0] for t in source}) == 1)


class BatchSource:
    """``next_batch(step)`` from a batch source (see the module docstring): a dataset of tensors
    (``batch_size`` random rows a step, from ``generator``), a callable ``step -> batch``, or an
    iterable, started again when it runs out."""

    def __init__(self, source, *, batch_size: int | None, generator: torch.Generator, what: str = "batches"):
        self.what, self.batch_size, self.generator = what, batch_size, generator
        self._iterator = None
        if is_dataset(source):
            if batch_size is None:
                raise ValueError(f"{what} is a dataset of {source[0].shape[0]} rows: pass batch_size= (rows per step)")
            self.kind = "dataset"
        elif isinstance(source, tuple) and source and all(torch.is_tensor(t) for t in source):
            raise ValueError(f"{what}: a tuple of tensors is a dataset and needs one leading size (rows) in every "
                             f"tensor, got shapes {[tuple(t.shape) for t in source]}")
        elif callable(source):
            self.kind = "callable"
        elif isinstance(source, Iterable) and not isinstance(source, (str, bytes, Mapping)) \
                and not torch.is_tensor(source):
            self.kind = "iterable"
        else:
            raise TypeError(f"{what} must be a tuple of tensors (a dataset), a callable step -> batch or an iterable "
                            f"of batches (a DataLoader, a list), got {type(source).__name__}")
        if self.kind != "dataset" and batch_size is not None:
            kind = "a callable" if self.kind == "callable" else "an iterable"
            raise ValueError(f"batch_size is read for the corpus and for a dataset of tensors; {what} is {kind} "
                             f"that sets its own batches: leave batch_size out")
        self.source = source

    def one_shot(self) -> bool:
        """An iterator that a second pass would not start again (a generator)."""
        return isinstance(self.source, Iterator)

    def next_batch(self, step: int):
        if self.kind == "dataset":
            rows = torch.randint(0, self.source[0].shape[0], (self.batch_size,), generator=self.generator)
            return tuple(t[rows] for t in self.source)
        if self.kind == "callable":
            return self.source(step)
        if self._iterator is None:
            self._iterator = iter(self.source)
        try:
            return next(self._iterator)
        except StopIteration:
            if self.one_shot():
                raise ValueError(f"{self.what} ran out at step {step}: an iterator is used once; pass a DataLoader, "
                                 f"a list of batches or a callable step -> batch") from None
            self._iterator = iter(self.source)  # a new epoch
            try:
                return next(self._iterator)
            except StopIteration:
                raise ValueError(f"{self.what} holds no batch") from None


@torch.no_grad()
def evaluate_batches(model, source: BatchSource, *, num_batches: int, loss_fn, device) -> float:
    """The mean loss over ``num_batches`` validation batches of ``source``, the same ones each time
    (a dataset's rows from a fixed generator, a callable's steps 1.., an iterable's first batches)."""
    if source.kind == "dataset":
        source = BatchSource(source.source, batch_size=source.batch_size, what=source.what,
                             generator=torch.Generator().manual_seed(1234))
    elif source.kind == "iterable":
        source._iterator = None  # from its first batch again
    was_training = model.training
    model.eval()
    losses = [model_loss(model, to_device(source.next_batch(i), device), loss_fn).item()
              for i in range(1, num_batches + 1)]
    model.train(was_training)
    return sum(losses) / len(losses)


def evaluate(model, data, *, batch_size: int, context: int, num_batches: int, device, loss_fn=None) -> float:
    """The mean loss over ``num_batches`` windows of the corpus split ``data``, the same each time."""
    gen = torch.Generator().manual_seed(1234)  # the same validation windows every time
    source = BatchSource(lambda step: get_batch(data, batch_size, context, gen), batch_size=None, generator=gen)
    return evaluate_batches(model, source, num_batches=num_batches, loss_fn=loss_fn, device=device)


# ---------------------------------------------------------------------------------- training


def train(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    steps: int,
    batch_size: int | None = None,
    context: int | None = None,
    eval_every: int = 0,
    eval_batches: int = 4,
    seed: int = 0,
    device: torch.device | str | None = None,
    scheduler=None,
    progress: bool = True,
    desc: str = "train",
    spectral_every: int = 0,
    loss_fn: Callable | str | None = None,
    batches: Any = None,
    val_batches: Any = None,
    qk_clip: float | QKClip | None = None,
    record: bool | str = True,
) -> History:
    """Train for ``steps`` steps; returns the History.

    By default on the corpus, for muonlab's GPT (``model(x, y)`` returns the loss): ``batch_size``
    (16) windows of ``context`` bytes (the model's) a step from a generator seeded with ``seed``, so
    two optimizers see the same data; ``eval_every`` > 0 also evaluates on the validation split (and
    always after the last step).

    Any model: ``batches`` is a batch source (see the module docstring: a dataset of tensors, a
    callable ``step -> batch``, a DataLoader or other iterable) and ``loss_fn`` a function
    ``(output, target) -> loss`` or a torch.nn.functional name ("cross_entropy"), or None for a
    model that returns its loss. ``batch_size`` is read for a dataset, ``seed`` seeds its draws.
    ``val_batches`` (a source of the same kinds) gives the validation loss over ``eval_batches``
    batches, every ``eval_every`` steps and after the last; without it there is none.

    ``spectral_every`` > 0 records every 2-D matrix's spectral metrics every that many steps into
    ``History.spectral`` (a SpectralRecorder; its time is inside ``step_time_s``). With muonlab's
    Muon, ``History.ns_choices`` says what Newton-Schulz ran (``Muon.resolved_choices()``).

    ``qk_clip``: tau (a number > 0) runs QK-clip (MuonClip: muonlab.optim.qk_clip.QKClip) on the
    model's attention after every optimizer step, ``math.inf`` records the max logits without
    clipping, a QKClip of your own is attached for the run (and left open); ``History.max_logit``,
    ``History.qk_clipped`` and ``History.qk_overshoot`` say what it saw and did.

    ``record``: True (default) keeps a run record (muonlab.runs) in a new folder
    ``runs/train-<date>`` (``$MUONLAB_RUNS_DIR`` as launch's), a string names the folder, False
    keeps none; ``History.record`` is the folder. It holds the model and optimizer as they were
    before step 1, so ``muonlab.runs.load(name).rerun()`` runs it again.
    """
    if qk_clip is not None and not isinstance(qk_clip, QKClip):
        check_tau(qk_clip, "qk_clip (tau, or a QKClip)")
    for name, value, low, what in (("steps", steps, 1, ""),
                                   ("eval_every", eval_every, 0, " (0: only after the last step)"),
                                   ("eval_batches", eval_batches, 1, ""),
                                   ("spectral_every", spectral_every, 0, " (0: no spectral records)"),
                                   ("batch_size", batch_size, 1, ""), ("context", context, 1, "")):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < low):
            raise ValueError(f"{name} must be an integer >= {low}{what}, got {value!r}")
    runs.check_record_arg(record)
    given_loss = loss_fn
    loss_fn = resolve_loss(loss_fn)
    gen = torch.Generator().manual_seed(seed)
    if batches is None:
        if val_batches is not None:
            raise ValueError("val_batches is read with batches of your own (batches=); the corpus has its "
                             "validation split")
        data = _corpus_batches(model, batch_size=16 if batch_size is None else batch_size, context=context,
                               eval_batches=eval_batches, loss_fn=loss_fn, generator=gen)
    else:
        if context is not None:
            raise ValueError("context is the corpus's window length; with batches of your own, leave it out")
        data = _own_batches(batches, val_batches, batch_size=batch_size, eval_every=eval_every,
                            eval_batches=eval_batches, loss_fn=loss_fn, generator=gen)
    device = torch.device(device) if device is not None else default_device()
    # before the model moves or trains: what a rerun starts from
    initial, why = runs.snapshot(model, optimizer, scheduler) if record is not False else (None, "")
    model.to(device).train()
    hist = History(tokens_per_step=data.tokens_per_step)
    recorder = SpectralRecorder(optimizer, model, every=spectral_every) if spectral_every else None
    if recorder is not None:
        hist.spectral = recorder.records  # the list it appends to
    clip = qk_clip if isinstance(qk_clip, QKClip) else None if qk_clip is None else QKClip(model, tau=qk_clip)
    first_record = len(clip.history) if clip is not None else 0
    if clip is not None:
        clip.attach(optimizer)
    try:
        _train_loop(model, optimizer, hist, data, steps=steps, eval_every=eval_every, device=device,
                    scheduler=scheduler, progress=progress, desc=desc)
    finally:  # the optimizer outlives the run: leave no hook on it
        if recorder is not None:
            recorder.detach()
        if clip is not None:
            clip.detach()
            if clip is not qk_clip:
                clip.close()
    if clip is not None:
        for clip_step in clip.history[first_record:]:
            hist.max_logit.append(torch.nn.utils.rnn.pad_sequence(clip_step.max_logit, batch_first=True,
                                                                  padding_value=float("nan")))
            hist.qk_clipped.append(clip_step.clipped_heads)
            hist.qk_overshoot.append(clip_step.overshoot)
    resolved = getattr(optimizer, "resolved_choices", None)
    hist.ns_choices = resolved() if callable(resolved) else []
    if record is not False:
        args = dict(steps=steps, batch_size=batch_size, context=context, eval_every=eval_every,
                    eval_batches=eval_batches, seed=seed, device=str(device), desc=desc, spectral_every=spectral_every,
                    qk_clip=None if qk_clip is None else clip.tau)
        _keep_record(hist, record, args, model=model, optimizer=optimizer, scheduler=scheduler, loss_fn=given_loss,
                     batches=batches, val_batches=val_batches, initial=initial, why=why, device=device)
    return hist


def _keep_record(hist: History, record: bool | str, args: dict, *, model, optimizer, scheduler, loss_fn, batches,
                 val_batches, initial, why: str, device) -> None:
    """Write ``train``'s run record (muonlab.runs); a failure to write warns and loses no result."""
    described, data = {}, {}
    for key, source in (("batches", batches), ("val_batches", val_batches)):
        described[key], kept = runs.describe_batches(
            source, batch_size=args["batch_size"] if key == "batches" or is_dataset(source) else None)
        if kept is not None:
            data[key] = kept
    config = dict(train=runs.encode(args), model=runs.describe_model(model),
                  optimizer=runs.describe_optimizer(optimizer),
                  scheduler=None if scheduler is None else type(scheduler).__name__,
                  loss_fn=runs.describe_loss(loss_fn), **described)
    if initial is None:
        config["initial_not_kept"] = why
    files = dict(initial=initial, data=data or None, series=dict(max_logit=hist.max_logit) if hist.max_logit else None)
    rec = runs.new_record("train", config=config, seeds=dict(batches=args["seed"]), device=device, history=hist,
                          files={k: v for k, v in files.items() if v is not None})
    try:
        hist.record = runs.save(rec, runs.claim_folder("train", record if isinstance(record, str) else None))
    except OSError as e:
        warnings.warn(f"train: the run record was not written ({e}); the History is returned as usual", stacklevel=3)


@dataclass
class _Data:
    """What the loop draws from: ``next_batch(step)``, ``val_loss(model, device)`` (None: no
    validation) and the tokens (rows) per step (None: counted from the first batch)."""

    next_batch: Callable[[int], Any]
    val_loss: Callable | None
    tokens_per_step: int | None
    loss_fn: Callable | None


def _corpus_batches(model, *, batch_size: int, context: int | None, eval_batches: int, loss_fn, generator) -> _Data:
    longest = getattr(getattr(model, "cfg", None), "context", None)  # the model's context, if it says
    if context is None and longest is None:
        raise ValueError("context must be given: the model has no cfg.context to take it from (or pass batches= "
                         "of your own, with loss_fn=, to train a model that is not muonlab's GPT)")
    context = longest if context is None else context
    if longest is not None and context > longest:
        raise ValueError(f"context {context} is longer than the model's ({longest})")
    train_data, val_data = load_corpus("train"), load_corpus("val")

    def val_loss(model, device):
        return evaluate(model, val_data, batch_size=batch_size, context=context, num_batches=eval_batches,
                        device=device, loss_fn=loss_fn)

    return _Data(lambda step: get_batch(train_data, batch_size, context, generator), val_loss,
                 batch_size * context, loss_fn)


def _own_batches(batches, val_batches, *, batch_size, eval_every: int, eval_batches: int, loss_fn, generator) -> _Data:
    source = BatchSource(batches, batch_size=batch_size, generator=generator)
    val_loss = None
    if val_batches is not None:
        val = BatchSource(val_batches, batch_size=batch_size if is_dataset(val_batches) else None,
                          generator=generator, what="val_batches")
        if val.one_shot():
            raise ValueError("val_batches is evaluated again every eval_every steps: pass a DataLoader, a list, a "
                             "dataset of tensors or a callable, not an iterator")

        def val_loss(model, device):
            return evaluate_batches(model, val, num_batches=eval_batches, loss_fn=loss_fn, device=device)
    elif eval_every:
        raise ValueError(f"eval_every={eval_every} needs val_batches= (a validation batch source) with batches of "
                         f"your own")
    return _Data(source.next_batch, val_loss, None, loss_fn)


def _train_loop(model, optimizer, hist: History, data: _Data, *, steps, eval_every, device, scheduler, progress,
                desc) -> None:
    start = time.monotonic()
    bar = _step_bar(desc, steps, progress)
    try:
        for step in range(1, steps + 1):
            batch = data.next_batch(step)
            if hist.tokens_per_step is None:
                hist.tokens_per_step = rows_of(batch)
            t0 = time.perf_counter()
            loss = model_loss(model, to_device(batch, device), data.loss_fn)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            wait_for(device)  # backward's kernels are not the optimizer's time
            t1 = time.perf_counter()
            optimizer.step()
            wait_for(device)
            t2 = time.perf_counter()
            if scheduler is not None:
                scheduler.step()
            hist.steps.append(step)
            hist.train_loss.append(loss.item())
            hist.step_time_s.append(t2 - t0)
            hist.opt_time_s.append(t2 - t1)
            if data.val_loss is not None and ((eval_every and step % eval_every == 0) or step == steps):
                if not hist.val_steps or hist.val_steps[-1] != step:
                    hist.val_steps.append(step)
                    hist.val_loss.append(data.val_loss(model, device))
            if bar is not None:
                bar.update(1)
    finally:  # a run that raises (or a Ctrl-C) closes its bar too: a notebook keeps it alive otherwise
        if bar is not None:
            bar.close()
    if bar is not None and in_notebook_kernel():  # the line a saved notebook keeps, where the bar's widget is gone
        print(f"{desc}: {steps} steps, loss {hist.train_loss[0]:.3f} -> {hist.train_loss[-1]:.3f}, "
              f"{time.monotonic() - start:.0f} s")


def _step_bar(desc: str, steps: int, progress: bool):
    if not progress:
        return None
    if in_notebook_kernel():
        return notebook_bar(desc, steps)
    return tqdm(total=steps, desc=desc, leave=False)


def compare_optimizers(model: GPTConfig | torch.nn.Module | Callable[[], torch.nn.Module], *, steps: int,
                       seed: int = 0, names=("muon", "adamw"), optimizer_kwargs: dict | None = None,
                       **train_kwargs) -> dict[str, History]:
    """Train the same initial model with each optimizer on the same batches; ``optimizer_kwargs``
    maps some of ``names`` to their make_optimizer keywords.

    ``model``: a GPTConfig (muonlab's GPT, built from ``seed``, on the corpus), an nn.Module (each
    optimizer trains a copy; the module itself is left as it is) or a function returning a new
    model (called after ``torch.manual_seed(seed)``). The other keywords go to :func:`train`: a
    model of your own needs ``batches=`` and usually ``loss_fn=`` there. The global RNG is seeded
    with ``seed`` before each run, so a shuffling DataLoader gives every optimizer the same order.
    Each run keeps its own record (``record``: a name becomes ``<name>-<optimizer>``).
    """
    record = train_kwargs.pop("record", True)
    runs.check_record_arg(record)
    if isinstance(names, str):
        raise TypeError(f"names must be a sequence of optimizer names, e.g. ({names!r},), not a str")
    names = tuple(names)
    unknown = [n for n in names if n not in OPTIMIZERS]
    if unknown or len(set(names)) != len(names):
        raise ValueError(f"names must be distinct, each one of {OPTIMIZERS}; got {names}")
    optimizer_kwargs = optimizer_kwargs or {}
    stray = sorted(set(optimizer_kwargs) - set(names))
    if stray:
        raise ValueError(f"optimizer_kwargs names {stray}, which is not in names {names}: its settings would go unused")
    if isinstance(model, GPTConfig):
        cfg = model
        build = lambda: GPT(cfg)  # noqa: E731
    elif isinstance(model, torch.nn.Module):
        original = model
        build = lambda: copy.deepcopy(original)  # noqa: E731
    elif callable(model):
        build = model
    else:
        raise TypeError(f"model must be a GPTConfig, an nn.Module or a function returning one, got {type(model).__name__}")
    batches = train_kwargs.get("batches")
    if len(names) > 1 and isinstance(batches, Iterator):
        raise ValueError("batches is an iterator, which the first optimizer would use up: pass a DataLoader, a list, "
                         "a dataset of tensors or a callable step -> batch")
    out = {}
    for name in names:
        torch.manual_seed(seed)
        net = build()
        if not isinstance(net, torch.nn.Module):
            raise TypeError(f"the model function returned {type(net).__name__}, not an nn.Module")
        opt = make_optimizer(name, net, **optimizer_kwargs.get(name, {}))
        out[name] = train(net, opt, steps=steps, seed=seed, desc=name,
                          record=f"{record}-{name}" if isinstance(record, str) else record, **train_kwargs)
    return out
