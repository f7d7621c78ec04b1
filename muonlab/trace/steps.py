"""The spans of many optimizer steps: a recorder for muonlab's Muon that keeps the last ``keep`` steps.

``Muon.last_step_spans()`` holds one step, the last. A ``StepRecorder`` attaches a step post-hook
(``optimizer.register_step_post_hook``: nothing in the optimizer changes) that copies those spans
after every ``every``-th step, each numbered with its step, into a ring of ``keep`` steps, so its
memory is bounded whatever the run's length (a step is a few spans per plan batch)::

    rec = StepRecorder(opt, keep=20)
    for ...: loss.backward(); opt.step(); opt.zero_grad()
    rows = rec.gather()            # every rank's spans of the kept steps on rank 0 (None elsewhere)
    muonlab.trace.step_time.exposed_comm_table(rows)

The clock is the optimizer's (``muonlab.trace.spans``): GPU time from CUDA events where the Muon
parameters live on a GPU, the host's wall clock elsewhere (``clock`` says which). Reading a step's
spans resolves them, so on CUDA each recorded step costs one device synchronisation after it (its
kernels must have ended for their events to be read); ``every`` > 1 records, and synchronises,
less often. A step Muon skipped (``nonfinite="skip"``) recorded no spans and is kept as a step
without any.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque

import torch

from ..kernels.precision import is_number
from .spans import RecordedSpans, Span

__all__ = ["CLOCKS", "StepRecorder"]

CLOCKS = {"gpu": "GPU time (CUDA events)", "host": "host wall clock"}
"""``StepRecorder.clock`` -> how figures and tables name it."""


def _whole(name: str, value, low: int) -> int:
    if not is_number(value) or not math.isfinite(value) or value != int(value) or value < low:
        raise ValueError(f"{name} must be a whole number >= {low}, got {value!r}")
    return int(value)


class StepRecorder(RecordedSpans):
    """Keeps the spans of ``optimizer``'s last ``keep`` recorded steps (see the module docstring).

    ``optimizer``: a muonlab ``Muon`` (anything with ``last_step_spans()`` and step hooks).
    ``keep``: steps kept (the oldest is dropped first); ``every``: record every k-th step;
    ``first_step``: the number of the first step after attaching (e.g. the training loop's index
    when attaching mid-run). Attaches on construction; ``detach()`` removes the hook.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, keep: int = 50, every: int = 1, first_step: int = 0):
        # checked before the hook is registered: a refused recorder leaves the optimizer as it was
        keep, every = _whole("keep", keep, 1), _whole("every", every, 1)
        first_step = _whole("first_step", first_step, 0)
        if not callable(getattr(optimizer, "last_step_spans", None)):
            raise TypeError(f"StepRecorder records muonlab's Muon (an optimizer with last_step_spans()); got "
                            f"{type(optimizer).__name__}, whose steps record no spans")
        self.optimizer, self.keep, self.every, self.first_step = optimizer, keep, every, first_step
        self.completed = 0
        """Steps completed since attaching, recorded or not (a step that raised runs no post-hook)."""
        self._kept: deque[tuple[int, list[Span]]] = deque(maxlen=keep)
        self._handle = optimizer.register_step_post_hook(self._after_step)

    def _after_step(self, optimizer, args, kwargs) -> None:
        step = self.first_step + self.completed
        self.completed += 1
        if (step - self.first_step) % self.every == 0:
            self._kept.append((step, [dataclasses.replace(s, step=step) for s in optimizer.last_step_spans()]))

    # ---------------------------------------------------------------- reading

    @property
    def steps(self) -> list[int]:
        """The numbers of the kept steps, oldest first."""
        return [step for step, _ in self._kept]

    @property
    def clock(self) -> str:
        """"gpu" where the spans are CUDA-event times, "host" where they are wall-clock times: Muon's
        own rule for its tracer (the Muon parameters' device), else any parameter on a GPU."""
        rule = getattr(self.optimizer, "_trace_device", None)
        if callable(rule):
            on_gpu = rule().type == "cuda"
        else:
            on_gpu = any(p.device.type == "cuda" for g in self.optimizer.param_groups for p in g["params"])
        return "gpu" if on_gpu else "host"

    def spans(self) -> list[Span]:
        """This rank's spans of the kept steps, step by step, each carrying its ``step``."""
        return [s for _, spans in self._kept for s in spans]

    # ---------------------------------------------------------------- lifetime

    def clear(self) -> None:
        """Drop the kept steps (the step count goes on)."""
        self._kept.clear()

    def detach(self) -> None:
        """Remove the hook; the kept steps stay readable."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
