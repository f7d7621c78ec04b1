"""Whole training steps on one timeline: forward, backward, FSDP2's all-gathers and reduce-scatters,
and the optimizer step's spans, per rank, over a window of steps.

``WholeStepRecorder(model, optimizer, steps=N)`` hangs hooks on the model (forward, and through
its output's gradient, backward) and on the optimizer (its step), and runs ``torch.profiler`` for
the N recorded steps only: a profiler session records every operator, so it stays off outside the
window. FSDP2 annotates its collectives with ``record_function`` ranges (``FSDP::all_gather``,
``FSDP::post_backward_reduce``, ...); the profiler gives those, the ``c10d::`` call that issues each
collective inside them, and the backend's own event for the transfer. Two ``record_function``
anchors, at the window's start and end, map the profiler's clock onto ``time.time()``, the clock of
the hooks and of Muon's spans (``muonlab.trace.spans``), so everything lies on one axis and ranks
on one machine line up.

Spans per rank and step (``Span.step`` numbers them as ``StepRecorder`` does):

- ``all_gather`` / ``reduce_scatter`` (communication, paths ``fsdp_all_gather`` /
  ``fsdp_reduce_scatter``): from the ``c10d::`` call that issues the collective to the end of the
  backend's transfer (gloo's ``gloo:<op>`` event on its own thread; a reduce-scatter runs there as
  ``gloo:all_reduce``), or to the end of FSDP2's range where the backend records no event;
- ``forward`` / ``backward`` (compute): from the model's forward pre-hook to its forward hook, and
  from the gradient of its output (or FSDP2's pre-backward hook on it, which runs first) to the end
  of the autograd pass (a callback queued on the engine, after FSDP2's own final reduce-scatter
  wait), minus the time the rank's thread spent inside
  FSDP2's collective ranges (issue, copy-in excluded, and wait: ``FSDP::all_gather``,
  ``all_gather_copy_out``, ``post_backward_reduce``, ``post_backward_rs_wait``) while one of its
  collectives was in flight: that is waiting, not computing, so a phase is cut into pieces there;
- the optimizer: a muonlab ``Muon``'s own spans of the step (``last_step_spans()``: momentum,
  comm_out, newton_schulz, comm_back, update, adamw); any other optimizer one ``optimizer``
  compute span from its step's pre-hook to its post-hook.

What the spans mean on the CPU with gloo: the work runs on the calling thread, so a compute span is
time that thread computed. FSDP2's collectives are synchronous there (``async_op=False`` blocks
until gloo's thread has moved the data), so their time is all exposed: ``exposed_comm_table``
(``muonlab.trace.step_time``) reports them next to Muon's paths, whose collectives are issued
asynchronously and overlap Newton-Schulz. Bytes are not recorded for FSDP2's collectives (the
profiler gives no message sizes): their spans carry 0 bytes and no "no bytes" outline.

On CUDA the same ranges are host-side: FSDP2 issues its all-gathers and reduce-scatters on streams
of their own, the host returns at once, and what overlaps is kernels on the compute and NCCL
streams. The spans that would mean the same there are the profiler's device activities (NCCL
kernels as communication, the other kernels as compute, as Holistic Trace Analysis reads them);
this recorder does not read them yet and refuses a model with parameters on a GPU rather than
report launch times as communication.
"""

from __future__ import annotations

import dataclasses
import time
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.autograd import Variable
from torch.profiler import ProfilerActivity, profile, record_function
from torch.utils._pytree import tree_flatten

from .._base import dist_on
from .spans import RecordedSpans, Span
from .step_time import merge, subtract
from .steps import _whole

__all__ = ["FSDP_COLLECTIVES", "ProfiledEvent", "WholeStepRecorder", "fsdp_collective_spans"]

FSDP_COLLECTIVES = {"FSDP::all_gather": ("all_gather", "fsdp_all_gather"),
                    "FSDP::post_backward_reduce": ("reduce_scatter", "fsdp_reduce_scatter")}
"""FSDP2's range that issues a collective -> (span name, path) of the collective."""

FSDP_WAITS = ("FSDP::all_gather", "FSDP::all_gather_copy_out", "FSDP::post_backward_reduce",
              "FSDP::post_backward_rs_wait")
"""FSDP2's ranges in which the rank's thread issues or waits for a collective."""

_ANCHOR = "muonlab::clock"


class ProfiledEvent(NamedTuple):
    """A profiler event on the host clock: its name, start and end (seconds) and thread id."""

    name: str
    start: float
    end: float
    thread: int


def _base(name: str) -> str:
    """FSDP2's range name without its module: "FSDP::all_gather (blocks.0)" -> "FSDP::all_gather"."""
    return name.split(" (", 1)[0]


def fsdp_collective_spans(events: list[ProfiledEvent], thread: int) -> tuple[list[tuple], list[tuple]]:
    """From a window's events: FSDP2's collectives issued on ``thread`` as ``(name, path, start,
    end)`` (see the module docstring), and the intervals in which ``thread`` sat in FSDP2's
    collective ranges while one was in flight (sorted, disjoint)."""
    mine = sorted((e for e in events if e.thread == thread), key=lambda e: e.start)
    issued = [e for e in mine if e.name.startswith("c10d::")]
    # every c10d call (FSDP2's, the optimizer's, any other) claims the backend's first unclaimed
    # event that starts after it: a process group runs its collectives in the order they were issued
    backend = sorted((e for e in events if e.thread != thread and e.name.startswith("gloo:")),
                     key=lambda e: e.start)
    transfer, k = {}, 0
    for call in issued:
        while k < len(backend) and backend[k].start < call.start:
            k += 1
        if k < len(backend):
            transfer[call] = backend[k]
            k += 1
    out = []
    for r in mine:
        kind = FSDP_COLLECTIVES.get(_base(r.name))
        calls = [c for c in issued if r.start <= c.start and c.end <= r.end] if kind else []
        if not calls:  # one rank: FSDP2 records the range but moves nothing
            continue
        end = transfer[calls[0]].end if calls[0] in transfer else r.end
        out.append((*kind, calls[0].start, max(end, calls[0].end)))
    in_flight = merge((s, e) for *_, s, e in out)
    waits = merge((r.start, r.end) for r in mine if _base(r.name) in FSDP_WAITS)
    blocked = merge((max(a, c), min(b, d)) for a, b in waits for c, d in in_flight if min(b, d) > max(a, c))
    return out, blocked


class WholeStepRecorder(RecordedSpans):
    """Records ``steps`` whole training steps of ``model`` and ``optimizer`` on this rank, after
    ``skip`` steps (see the module docstring)::

        rec = WholeStepRecorder(model, opt, steps=3, skip=1)  # step 0 builds Muon's plan
        for x, y in batches:  # the loop as it is: forward, backward, opt.step()
            ...
        rows = rec.gather()  # every rank's spans on rank 0, for plot_timeline / exposed_comm_table

    A step runs from the first forward after the previous optimizer step to the end of
    ``optimizer.step()``. ``first_step``: the number of the first step after attaching.
    ``detach()`` removes the hooks (and stops a window still open); ``done`` says the window is
    over. A ValueError names ``steps``, ``skip``, ``first_step`` or a model with GPU parameters;
    a TypeError a model or optimizer of the wrong kind, before any hook is attached.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, steps: int, skip: int = 0,
                 first_step: int = 0):
        steps, skip = _whole("steps", steps, 1), _whole("skip", skip, 0)
        first_step = _whole("first_step", first_step, 0)
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"model must be a torch.nn.Module (the root: FSDP2's outermost module), got "
                            f"{type(model).__name__}")
        if not callable(getattr(optimizer, "register_step_post_hook", None)):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer (step hooks), got {type(optimizer).__name__}")
        on_gpu = sorted({str(p.device) for p in model.parameters() if p.device.type == "cuda"})
        if on_gpu:
            raise ValueError(f"model has parameters on {on_gpu}: WholeStepRecorder reads host-side ranges, which on "
                             "CUDA time launches, not the streams' work (see muonlab.trace.whole_step)")
        self.model, self.optimizer = model, optimizer
        self.steps, self.skip, self.first_step = steps, skip, first_step
        self.completed = 0
        """Optimizer steps completed since attaching."""
        self.rank = dist.get_rank() if dist_on() else 0
        self._profiler = None
        self._anchors: list[float] = []  # host seconds at the window's two clock anchors
        self._phases: list[tuple[int, str, float, float]] = []  # (step, phase, start, end), host clock
        self._optimizer_spans: list[Span] = []
        self._spans: list[Span] | None = None
        self._in_step = self._in_backward = False
        self._forward_start = self._backward_start = self._opt_start = 0.0
        self._handles = [
            # prepended: before FSDP2's root pre-forward, whose all-gather then falls inside the step
            model.register_forward_pre_hook(self._before_forward, prepend=True),
            model.register_forward_hook(self._after_forward),
            optimizer.register_step_pre_hook(self._before_step),
            optimizer.register_step_post_hook(self._after_step),
        ]

    # ---------------------------------------------------------------- hooks

    @property
    def _recording(self) -> bool:
        return self.skip <= self.completed < self.skip + self.steps

    @property
    def _step(self) -> int:
        return self.first_step + self.completed

    def _before_forward(self, module, args) -> None:
        if not self._recording:
            return
        if self._profiler is None:
            self._profiler = profile(activities=[ProfilerActivity.CPU])
            self._profiler.start()
            self._anchor()
        self._in_step = True
        self._forward_start = time.time()

    def _after_forward(self, module, args, output) -> None:
        if not (self._recording and self._in_step):
            return
        self._phases.append((self._step, "forward", self._forward_start, time.time()))
        if torch.is_grad_enabled():
            for t in tree_flatten(output)[0]:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(self._backward_began)

    def _backward_began(self, grad):
        if not self._in_backward:  # the first of the output's tensors to get its gradient
            self._in_backward, self._backward_start = True, time.time()
            Variable._execution_engine.queue_callback(self._backward_ended)
        return None

    def _backward_ended(self) -> None:
        self._in_backward = False
        if self._recording:
            self._phases.append((self._step, "backward", self._backward_start, time.time()))

    def _before_step(self, optimizer, args, kwargs) -> None:
        self._opt_start = time.time()

    def _after_step(self, optimizer, args, kwargs) -> None:
        if self._recording and self._in_step:
            step = self._step
            own = getattr(optimizer, "last_step_spans", None)
            if callable(own):
                spans = [dataclasses.replace(s, step=step) for s in own()]
            else:
                spans = [Span("optimizer", self._opt_start, time.time(), rank=self.rank, step=step)]
            self._optimizer_spans.extend(spans)
        self._in_step = False
        self.completed += 1
        if self._profiler is not None and not self._recording:
            self._finish()
        elif self._spans is None and self.completed >= self.skip + self.steps:
            self._spans = []  # the window passed without a forward of the model: nothing to record

    # ---------------------------------------------------------------- the window's end

    def _anchor(self) -> None:
        """A host time beside a profiler range: the two clocks' correspondence."""
        before = time.time()
        with record_function(_ANCHOR):
            pass
        self._anchors.append((before + time.time()) / 2)

    def _finish(self) -> None:
        self._anchor()
        profiler, self._profiler = self._profiler, None
        profiler.stop()
        raw = [e for e in profiler.events() if e.name.startswith(("FSDP::", "c10d::", "gloo:", _ANCHOR))]
        anchors = sorted((e for e in raw if e.name == _ANCHOR), key=lambda e: e.time_range.start)
        if len(anchors) != 2:
            raise RuntimeError(f"the profiler kept {len(anchors)} of the window's 2 clock anchors")
        # a straight line through both anchors' middles: the offset, and any difference in rate
        h0, h1 = self._anchors
        p0, p1 = ((a.time_range.start + a.time_range.end) / 2e6 for a in anchors)
        rate = (h1 - h0) / (p1 - p0) if p1 > p0 else 1.0

        def host(us: float) -> float:
            return h0 + (us / 1e6 - p0) * rate

        events = [ProfiledEvent(e.name, host(e.time_range.start), host(e.time_range.end), e.thread) for e in raw
                  if e.name != _ANCHOR]
        self._spans = self._build(events, anchors[0].thread)

    def _build(self, events: list[ProfiledEvent], thread: int) -> list[Span]:
        collectives, blocked = fsdp_collective_spans(events, thread)
        # FSDP2's pre-backward hook sits on the output too, registered before this recorder's, so it
        # runs (the root's all-gather) before the output's gradient reaches this recorder: the
        # backward starts at the earlier of the two
        pre_backward = sorted(e.start for e in events if e.thread == thread and _base(e.name) == "FSDP::pre_backward")
        by_step: dict[int, list[Span]] = {}
        last_forward_end = float("-inf")
        for step, phase, start, end in self._phases:
            if phase == "forward":
                last_forward_end = end
            else:
                start = min([start, *(t for t in pre_backward if last_forward_end <= t < start)])
            for a, b in subtract([(start, end)], blocked):
                by_step.setdefault(step, []).append(Span(phase, a, b, rank=self.rank, step=step))
        extents = {step: (min(s.start for s in spans), max(s.end for s in spans)) for step, spans in by_step.items()}
        for name, path, start, end in collectives:
            # a collective belongs to the step whose forward-backward issued it
            step = next((s for s, (a, b) in extents.items() if a <= start <= b), None)
            if step is None:
                step = next((s for s, (a, _) in sorted(extents.items(), reverse=True) if a <= start), None)
            if step is not None:
                by_step[step].append(Span(name, start, end, rank=self.rank, path=path, step=step))
        for s in self._optimizer_spans:
            by_step.setdefault(s.step, []).append(s)
        return [s for step in sorted(by_step) for s in sorted(by_step[step], key=lambda s: (s.start, s.end))]

    # ---------------------------------------------------------------- reading

    @property
    def done(self) -> bool:
        """The window is over: its spans are ready."""
        return self._spans is not None

    def spans(self) -> list[Span]:
        """This rank's spans of the recorded steps, step by step, each carrying its ``step``. A
        RuntimeError while the window is still open (``completed`` of ``skip + steps`` steps)."""
        if self._spans is None:
            raise RuntimeError(f"the window is still open: {self.completed} of {self.skip + self.steps} steps "
                               "completed (skip + steps)")
        return list(self._spans)

    def detach(self) -> None:
        """Remove the hooks; a window still open is dropped (its profiler stopped)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._profiler is not None:
            self._profiler.stop()
            self._profiler = None
