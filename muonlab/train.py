"""The small training loop behind the demo, the notebooks and the benchmarks."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from .bars import in_notebook_kernel, notebook_bar
from .data import get_batch, load_corpus
from .distributed.device import rank_device, wait_for
from .models import GPT, GPTConfig
from .optim import Muon, muon_param_groups
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
    spectral: list[SpectralRecord] = field(default_factory=list)
    """Spectral records of the matrices every ``spectral_every`` steps (muonlab.trace.spectral)."""

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


@torch.no_grad()
def evaluate(model, data, *, batch_size: int, context: int, num_batches: int, device) -> float:
    gen = torch.Generator().manual_seed(1234)  # the same validation windows every time
    was_training = model.training
    model.eval()
    losses = []
    for _ in range(num_batches):
        x, y = get_batch(data, batch_size, context, gen)
        losses.append(model(x.to(device), y.to(device)).item())
    model.train(was_training)
    return sum(losses) / len(losses)


def train(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    steps: int,
    batch_size: int = 16,
    context: int | None = None,
    eval_every: int = 0,
    eval_batches: int = 4,
    seed: int = 0,
    device: torch.device | str | None = None,
    scheduler=None,
    progress: bool = True,
    desc: str = "train",
    spectral_every: int = 0,
) -> History:
    """Train on the corpus for ``steps`` steps; returns the History.

    Batches come from a generator seeded with ``seed``, so two optimizers see the same data.
    ``eval_every`` > 0 also evaluates on the validation split (and always after the last step).
    ``spectral_every`` > 0 records every 2-D matrix's spectral metrics every that many steps into
    ``History.spectral`` (a SpectralRecorder; its time is inside ``step_time_s``).
    """
    longest = getattr(getattr(model, "cfg", None), "context", None)  # the model's context, if it says
    if context is None and longest is None:
        raise ValueError("context must be given: the model has no cfg.context to take it from")
    for name, value, low, what in (("steps", steps, 1, ""), ("batch_size", batch_size, 1, ""),
                                   ("eval_every", eval_every, 0, " (0: only after the last step)"),
                                   ("eval_batches", eval_batches, 1, ""),
                                   ("spectral_every", spectral_every, 0, " (0: no spectral records)"),
                                   ("context", longest if context is None else context, 1, "")):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}{what}, got {value!r}")
    context = longest if context is None else context
    if longest is not None and context > longest:
        raise ValueError(f"context {context} is longer than the model's ({longest})")
    device = torch.device(device) if device is not None else default_device()
    train_data, val_data = load_corpus("train"), load_corpus("val")
    gen = torch.Generator().manual_seed(seed)
    model.to(device).train()
    hist = History(tokens_per_step=batch_size * context)
    recorder = SpectralRecorder(optimizer, model, every=spectral_every) if spectral_every else None
    if recorder is not None:
        hist.spectral = recorder.records  # the list it appends to
    try:
        _train_loop(model, optimizer, hist, steps=steps, batch_size=batch_size, context=context,
                    eval_every=eval_every, eval_batches=eval_batches, gen=gen, device=device,
                    scheduler=scheduler, progress=progress, desc=desc, data=(train_data, val_data))
    finally:  # the optimizer outlives the run: leave no hook on it
        if recorder is not None:
            recorder.detach()
    return hist


def _train_loop(model, optimizer, hist: History, *, steps, batch_size, context, eval_every, eval_batches,
                gen, device, scheduler, progress, desc, data) -> None:
    train_data, val_data = data
    start = time.monotonic()
    bar = _step_bar(desc, steps, progress)
    try:
        for step in range(1, steps + 1):
            x, y = get_batch(train_data, batch_size, context, gen)
            t0 = time.perf_counter()
            loss = model(x.to(device), y.to(device))
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
            if (eval_every and step % eval_every == 0) or step == steps:
                if not hist.val_steps or hist.val_steps[-1] != step:
                    hist.val_steps.append(step)
                    hist.val_loss.append(
                        evaluate(model, val_data, batch_size=batch_size, context=context,
                                 num_batches=eval_batches, device=device)
                    )
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


def compare_optimizers(cfg: GPTConfig, *, steps: int, seed: int = 0, names=("muon", "adamw"),
                       optimizer_kwargs: dict | None = None, **train_kwargs) -> dict[str, History]:
    """Train the same initial model with each optimizer on the same batches; ``optimizer_kwargs``
    maps some of ``names`` to their make_optimizer keywords."""
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
    out = {}
    for name in names:
        torch.manual_seed(seed)
        model = GPT(cfg)
        opt = make_optimizer(name, model, **optimizer_kwargs.get(name, {}))
        out[name] = train(model, opt, steps=steps, seed=seed, desc=name, **train_kwargs)
    return out
