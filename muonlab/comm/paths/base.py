"""What a communication path is: its facts, and the shape of its per-batch generator.

Each module of this package is one path and owns everything about it: a ``CommPath`` record
(name, collectives, overlap share, colour, generator), its byte formula, and the generator that
runs one batch on one rank. The generator follows dion's megabatch-task shape:

    def run(batch, inputs, ctx):
        pending = ctx.send(<out collective>)    # start moving inputs to the owners (async)
        yield                                   # the engine starts the next batch meanwhile
        mats = <whole matrices from ctx.wait(pending)>, or None if this rank orthogonalizes nothing
        ortho = ctx.orthogonalize(mats)         # exactly once per batch; None in, None out
        pending = ctx.send(<back collective>)   # start returning each rank its share
        yield
        return [this rank's output for each parameter of the batch, in input order]

``inputs`` are this rank's local momentum tensors of the batch's parameters (None for a replicated
parameter it does not own). ``ctx`` (muonlab.comm.engine.BatchRun) gives the group, the group rank
and the wire dtype, counts each collective's bytes once at ``send``, and times the phases.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass

PathRunner = Callable[..., Generator[None, None, list]]


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
    summary: str
