"""Muon's hot step captured whole in a CUDA graph after warm-up, then replayed
(``Muon(capture_after=N)``).

A step has two parts (muonlab.optim.prepared): the host part, run at every step before anything
is written (the prepared step's key, validation when something changed, the ranks' agreement
exchange on gloo), and the hot step, which only launches device work: momentum, the paths'
collectives (NCCL), Newton-Schulz, the update, AdamW, the non-finite gate. The hot step runs
eagerly ``after`` times with the same key; the next step captures it in a CUDA graph and
replays it, and every later step with that key runs the host part, then one replay.

What the graph reads must stay where it was at capture, so the key holds, besides the prepared
step's key and the settings, the addresses of every parameter and gradient this step reads: a
gradient made anew (``zero_grad(set_to_none=True)``, torch's default) or a setting changed (a float
lr under a scheduler) drops the graph and the step warms up and captures again, with a warning
saying why (a key that changes at every step, a float lr under a scheduler, keeps the step eager).
A tensor lr on the parameters' device is read by the graph where a scheduler fills it, so it
changes nothing here. ``release()`` drops the graph (and its memory pool): Muon calls it when its
state is loaded, and a run should call it (``Muon.drop_captured_step()``) before
``dist.destroy_process_group()``, whose NCCL communicators a live graph holds.

A capture that fails (something in the step a graph can't hold) raises once, naming the cause;
that step is not applied, and the optimizer's later steps run eagerly.

A replay records no spans: a replayed step's ``last_step_stats()`` gives the captured step's bytes
and calls, whether it was skipped and by which ranks (read from the replay's own flags), and no
seconds; ``last_step_spans()`` is empty. For a timeline, ask for an eager step
(``Muon.trace_next_step()``): the next step runs eagerly, with its spans and seconds, and the
graph is kept for the steps after it (an eager step runs what the graph holds, on the same
tensors).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch


class StepGraph:
    """The capture and replay of one optimizer's hot step (see the module doc)."""

    def __init__(self, after: int):
        self.after = after
        self._key = None  # what the eager steps counted in _eager, or the graph, were made for
        self._eager = 0
        self._graph: torch.cuda.CUDAGraph | None = None
        self.captured_stats: tuple | None = None  # the optimizer's (stats, their gate) after the capture
        self._warned: set[str] = set()
        self.failed: str | None = None  # why a capture failed: every later step then runs eagerly
        self._eager_next = False  # the next step runs eagerly, the graph kept (trace_next_step)

    def mode(self, key: tuple, why_new: Callable[[tuple, tuple], str]) -> str:
        """"replay" (a graph for ``key``), "capture" (``after`` eager steps with ``key`` ran) or
        "eager". A new key drops the graph; ``why_new(old, new)`` says why, for the warning given
        the first time a graph is dropped for that reason. After ``eager_next()``, this step is
        "eager" whatever else holds (a graph is kept; a due capture waits a step)."""
        eager_asked, self._eager_next = self._eager_next, False
        if key != self._key:
            if self._graph is not None:
                self._warn(why_new(self._key, key))
            self.release()
            self._key, self._eager = key, 0
        if eager_asked:
            return "eager"
        if self._graph is not None:
            return "replay"
        return "capture" if self._eager >= self.after and self.failed is None else "eager"

    def ran_eagerly(self) -> None:
        self._eager += 1

    def eager_next(self) -> None:
        """Run the next step eagerly (its spans recorded), keeping the graph for the steps after."""
        self._eager_next = True

    def capture(self, hot_step: Callable[[], None]) -> None:
        """Capture ``hot_step`` (which, captured, runs no kernel) and replay it once: this step.
        If the capture fails, this step raises a RuntimeError saying why, and every later step
        runs eagerly (``failed``): a step that can't be captured is not tried again each step."""
        try:
            graph = torch.cuda.CUDAGraph()
            # "thread_local": the NCCL watchdog thread queries events while this thread captures
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                hot_step()
        except Exception as err:
            self.failed = f"{type(err).__name__}: {err}"
            raise RuntimeError(f"capture_after: the step could not be captured in a CUDA graph ({self.failed}); "
                               "this step was not applied, and the steps from the next one on run eagerly") from err
        self._graph = graph
        graph.replay()

    def replay(self) -> None:
        self._graph.replay()

    @property
    def captured(self) -> bool:
        return self._graph is not None

    def release(self) -> None:
        """Drop the graph (after the device finished its last replay) and count warm-up anew."""
        graph, self._graph, self.captured_stats = self._graph, None, None
        self._eager = 0
        if graph is not None:
            torch.cuda.synchronize()
            graph.reset()

    def _warn(self, why: str) -> None:
        if why not in self._warned:
            self._warned.add(why)
            warnings.warn(f"capture_after: the captured step was dropped ({why}); the step warms up and is "
                          "captured again", RuntimeWarning, stacklevel=5)


def check_capture(options) -> None:
    """``capture_after`` and the other options a captured step needs, each refused by name
    (``options``: a ``MuonOptions``, which runs this when made)."""
    capture_after = options.capture_after
    if capture_after is None:
        return
    if isinstance(capture_after, bool) or not isinstance(capture_after, int) or capture_after < 1:
        raise ValueError(f"capture_after must be None or an int >= 1 (eager steps before the capture: they make "
                         f"the state, the plan and the kernel choices), got {capture_after!r}")
    if options.nonfinite == "raise" or (options.nonfinite == "skip" and options.nonfinite_decision == "host"):
        raise ValueError(f'capture_after needs nonfinite_decision="device" (or nonfinite="ignore"): '
                         f'nonfinite={options.nonfinite!r} with nonfinite_decision={options.nonfinite_decision!r} '
                         "reads a flag on the host at every step")
    if options.ns_graphs:
        raise ValueError("capture_after captures Newton-Schulz with the rest of the step: ns_graphs must be False")


def check_capture_place(capture_after, state_offload, params, label) -> None:
    """What ``capture_after`` needs of where the state and ``params`` live (the options record
    knows neither): no state offload, and CUDA parameters (``label(p)`` names one)."""
    if capture_after is None:
        return
    if state_offload is not None:
        raise ValueError(f"capture_after needs the state on the parameters' device, got state_offload={state_offload!r}")
    for p in params:
        device = getattr(p, "device", None)
        if device is None or device.type != "cuda":
            raise ValueError(f"capture_after needs CUDA parameters: parameter {label(p)} is on {device}")
