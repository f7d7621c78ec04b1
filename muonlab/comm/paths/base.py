"""What a communication path is: its facts, and the shape of its per-batch generator.

Each module of this package is one path and owns everything about it: a ``CommPath`` record
(name, collectives, overlap share, colour, generator), its byte formula, and the generator that
runs one batch on one rank (dion's megabatch-task shape). The generator only ever hands work to
the engine by yielding it, and gets the result back from the ``yield``:

    def run(batch, inputs, ctx):
        received = yield <out collective>      # a Pending: the engine counts its bytes, starts the
                                               # next batch, then waits and sends the tensor in
        ortho = yield <whole matrices or None> # the engine runs Newton-Schulz (batch.ns_config) on
                                               # a (k, A, B) stack, a list of such pieces, or an
                                               # Overwrite list (the result replaces the pieces)
        returned = yield <back collective>     # a Pending again
        return [this rank's output for each parameter of the batch, in input order]

A path without a way out or a way back skips that yield; every path yields its matrices exactly
once (None when this rank orthogonalizes nothing). ``inputs`` are this rank's local momentum
tensors of the batch's parameters (None for a replicated parameter it does not own); ``ctx`` is a
``PathContext``.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import NamedTuple

import torch

PathRunner = Callable[..., Generator]


class Itemsizes(NamedTuple):
    """Element sizes a batch's buffers are made in."""

    momentum: int
    """The momentum inputs' (a send buffer that is one input in the wire dtype is the input)."""
    ns: int | None
    """Newton-Schulz's output (its compute dtype); None: the dtype of what it is handed."""
    wire: int
    """On the wire (``BatchPlan.comm_itemsize``)."""


class Phases(NamedTuple):
    """Bytes one rank's batch allocates at each place the engine counts (muonlab.comm.memory)."""

    start: int = 0
    compute: int = 0
    finish: int | None = 0
    """None: the batch has no way back; its outputs are in ``compute`` and it is applied there."""


@dataclass(frozen=True)
class PathContext:
    """Where a batch runs on this rank."""

    group: object
    """The torch ProcessGroup of the batch's GroupKey (None for a single process)."""
    group_rank: int
    """This rank's index in that group."""
    wire_dtype: torch.dtype
    """Dtype of matrices on the wire."""
    device: torch.device | None = None
    """Where this rank's tensors live (a rank holding no input of a batch makes its empty buffers
    there: a CPU tensor can't join an NCCL collective); None: the CPU."""
    defer: bool = False
    """The batch travels in a wave (``BatchPlan.travels_with``): its path hands back its
    collectives unissued (``all_to_all(..., defer=True)``) and the engine sends the wave's together."""


@dataclass(frozen=True, kw_only=True)
class CommPath:
    """The facts of one path that the engine, the cost model and viz read."""

    name: str
    collectives: int
    """Collectives one batch issues on a rank, out and back (latency in the cost model)."""
    out_share: float
    """Share of the batch's communication time before Newton-Schulz can start; the rest, the
    way back, runs behind later batches (the cost model's pipeline)."""
    color: str
    """Its colour in timelines and plan charts."""
    run: PathRunner | None
    """The per-batch generator; None for a path that exists only in simulated reference plans."""
    plans_layout: str | None = None
    """A layout (muonlab.comm.specs.LAYOUTS) whose buckets this path plans by itself, with
    ``plan_bucket``, instead of the planner's own branches; None: the planner picks the path."""
    plan_bucket: Callable[..., None] | None = None
    """``(planner, group, idx)``: append the batches of one bucket of ``plans_layout`` (``idx``:
    spec indices sharing group, shape, dtype and config) to ``planner.batches``
    (muonlab.comm.planner.rule.RulePlanner: ``specs``, ``configs``, ``make``, ``loads``, ``flops_of``,
    ``itemsize_of``, ``max_local_matrices``: the workspace budget's matrices per rank, or None)."""
    prepare_groups: Callable[..., None] | None = None
    """``(batch)``: make the process groups a batch needs, collectively (every rank, in plan
    order) when the optimizer plans, never mid-step; None: the batch's group is enough."""
    ranks_reached: Callable[..., int] | None = None
    """``(batch)``: how many ranks of its group slice one rank of the batch exchanges with, for the
    cost model's intra/inter-node split; None: the whole slice."""
    waves: bool = False
    """Its small batches may travel in a wave (muonlab.comm.planner.coalesce): each way is one
    all_to_all_single with split sizes, its ``run`` hands it back unissued under ``ctx.defer``, and
    ``wire_buffers`` gives the wave's buffers."""
    state_homes: Callable[..., dict] | None = None
    """``(batch, group_rank)``: {parameter index: (its owner's group rank, whether it is this rank)}
    for a path on which one rank of a replicated parameter's group keeps its optimizer state (the
    other replicas keep none); None: every rank keeps its own."""
    least_bytes: Callable[..., float] | None = None
    """``(batch, itemsize)``: the fewest bytes any plan moves for the batch's parameters, summed over
    one slice of its group (muonlab.simulate.lower_bound_bytes); None: a row-sharded layout's."""
    buffer_bytes: Callable[..., list[Phases]] | None = None
    """``(batch, sizes: Itemsizes)``: per group-local rank, the bytes of the buffers its generator
    allocates at each phase the engine counts (muonlab.comm.memory); the engine's count equals it."""
    wire_buffers: Callable[..., list] | None = None
    """A path that can travel in a wave: ``(batch)`` -> per group-local rank ((out send, out
    receive), (back send, back receive)) elements of its collectives' buffers, which a wave's
    combined buffers hold again."""
