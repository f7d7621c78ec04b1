"""``padded_all_to_all``: a reference path that exists only in simulated plans, never run.

Batches of W row-sharded matrices through an all-to-all in which uneven shards are padded to
ceil(A/W) rows and a short batch is padded with zero matrices, which still travel and are still
orthogonalized (the behaviour XTuner's FSDP2 Muon started with). muonlab's planner compares its
own plans against it (muonlab.comm.planner.reference).
"""

from __future__ import annotations

from .base import CommPath


def bytes_per_rank(size: int, padded_block: int):
    """(sent, recv) per rank: out and back, every rank exchanges one padded block with every other."""
    sent = [2 * (size - 1) * padded_block] * size
    return sent, list(sent)


PATH = CommPath(name="padded_all_to_all", collectives=2, out_share=0.5, color="#8c6d31", run=None)
