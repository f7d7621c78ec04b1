"""What two reference strategies would do on the same matrices (simulation only, never run).

* ``padded_all_to_all``: every row-sharded bucket goes in batches of W matrices through an
  all-to-all; uneven shards are padded to ceil(A/W) rows and a short last batch is padded with
  zero matrices, which still travel and are still orthogonalized (the behaviour XTuner's FSDP2
  Muon started with; the path's facts are in muonlab.comm.paths.padded_all_to_all).
* ``xtuner``: XTuner's later rules: full batches as above (padded shards), remainder batches of
  k < W matrices by all-gather (padded shards), matrix i orthogonalized on rank i % W, and a
  reduce-scatter of the k padded matrices back.

Both keep muonlab's handling of layouts they don't cover (whole experts: local; replicated: owner),
so the comparison isolates the sharded-matrix paths. Records are ``BatchPlan``s, so the cost
model and tables treat them like muonlab's own.
"""

from __future__ import annotations

from collections.abc import Sequence

from ...kernels.config import NSConfig, ns_flops
from ..paths import padded_all_to_all
from ..records import BatchPlan, Plan
from ..specs import MatrixSpec
from ..wire import ItemsizeRule, itemsize_rule
from .search import plan_batches

REFERENCE_STRATEGIES = ("padded_all_to_all", "xtuner")


def reference_plan(strategy: str, specs: Sequence[MatrixSpec], configs: Sequence[NSConfig], *,
                   comm_itemsize: int | ItemsizeRule = 2) -> Plan:
    """The plan of reference ``strategy``; ``comm_itemsize`` as ``plan_batches`` takes it."""
    if strategy not in REFERENCE_STRATEGIES:
        raise ValueError(f"unknown reference strategy {strategy!r}; choose one of {REFERENCE_STRATEGIES}")
    sharded = [i for i, s in enumerate(specs) if s.layout == "row_shard"]
    others = [i for i, s in enumerate(specs) if s.layout != "row_shard"]
    batches = list(plan_batches([specs[i] for i in others], [configs[i] for i in others],
                                comm_itemsize=comm_itemsize))
    itemsize_of = itemsize_rule(comm_itemsize)
    buckets: dict[tuple, list[int]] = {}
    for i in sharded:  # one wire dtype per bucket, as in muonlab's plans
        key = (specs[i].group, specs[i].matrix_shape, configs[i], itemsize_of(specs[i], configs[i]))
        buckets.setdefault(key, []).append(i)
    for (group, (A, B), cfg, itemsize), idx in buckets.items():
        W = group.size
        block = -(-A // W) * B * itemsize  # one rank's padded shard of one matrix
        per_matrix = ns_flops((A, B), cfg)
        for start in range(0, len(idx), W):
            chunk = idx[start:start + W]
            k = len(chunk)
            if strategy == "padded_all_to_all" or k == W:
                sent, _ = padded_all_to_all.bytes_per_rank(W, block)
                flops = [per_matrix] * W  # zero matrices padding the batch are computed too
                path, notes = "padded_all_to_all", ("" if k == W else f"{W - k} zero matrices padded in")
            else:
                # XTuner's remainder: all-gather of k padded shards, reduce-scatter of k padded matrices
                sent = [2 * (W - 1) * k * block] * W
                flops = [per_matrix if r < k else 0 for r in range(W)]
                path, notes = "agrs", f"remainder: {k} < {W}, padded shards, reduce-scatter back"
            batches.append(BatchPlan(
                index=len(batches), path=path, names=tuple(specs[i].name for i in chunk),
                param_indices=tuple(specs[i].index for i in chunk), matrix_shape=(A, B), num_matrices=k,
                group=group, ns_config=cfg, ranks=tuple(range(W)), owners=tuple(range(k)),
                bytes_sent=tuple(sent), bytes_recv=tuple(sent), flops=tuple(flops), rows=specs[chunk[0]].rows,
                param_shapes=tuple(specs[i].shape for i in chunk), notes=notes, comm_itemsize=itemsize))
    return Plan(tuple(batches))
