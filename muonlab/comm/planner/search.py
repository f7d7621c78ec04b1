"""The planner's entry point: check the options, then search over owner rules for the best plan."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from ...kernels.config import NSConfig, ns_flops
from ..cost import get_profile, step_seconds
from ..records import Plan, flops_per_rank
from ..specs import MatrixSpec
from ..wire import ItemsizeRule
from .coalesce import coalesce
from .rule import ROW_RULES, RulePlanner

REMAINDER_PATHS = ("auto", "all_to_all", "agrs")
# "muonlab": the planner. "redundant": the baseline every distributed Muon is measured against, in
# which every rank gathers and orthogonalizes every matrix.
STRATEGIES = ("muonlab", "redundant")
ROW_ASSIGNMENTS = ("best",) + ROW_RULES


def plan_batches(
    specs: Sequence[MatrixSpec],
    configs: Sequence[NSConfig],
    *,
    comm_itemsize: int | ItemsizeRule = 2,
    remainder_path: str = "auto",
    strategy: str = "muonlab",
    profile=None,
    row_assignment: str = "best",
    rebalance: bool | None = None,
    max_local_matrices=None,
) -> Plan:
    """Group matrices into batches and give each a path, owners, bytes and FLOPs.

    Args:
        specs: one MatrixSpec per Muon parameter, in the optimizer's order (same on every rank).
        configs: the Newton-Schulz config of each parameter; only equal configs share a batch.
        comm_itemsize: bytes per element on the wire (2 for bf16, 4 for fp32), or per batch a
            function (spec, config) -> bytes (``muonlab.comm.wire.wire_itemsizes``: Muon's
            ``comm_dtype="auto"``); each batch records its own (``BatchPlan.comm_itemsize``).
        remainder_path: path of a row-sharded batch with fewer matrices than ranks (a bucket
            smaller than the group, or a budget's last cut of one); "auto"
            takes whichever of all_to_all and agrs has the lower modelled time under ``profile``.
        strategy: "muonlab" or "redundant" (see STRATEGIES).
        profile: a cost.HardwareProfile or its name (default "cpu_gloo"), for "auto" and "best".
        row_assignment: "best" or one of ``ROW_RULES`` (see rule.py): how row-sharded matrices
            get owners. "best" plans every rule and keeps the best-balanced, then fastest, plan.
        rebalance: move whole matrices off overloaded ranks (None: plan both ways under "best").
        max_local_matrices: ``f(matrix shape, config) -> int``, the most matrices per rank one batch
            of whole matrices may hold (the optimizer's workspace budget); a larger bucket becomes
            several batches of whole parameters, and an expert bank larger than it, batches of
            its parts (``BatchPlan.part``); a bucket of row-sharded matrices, batches in which no
            owner gathers more than that many; a bucket of replicated parameters, batches of
            about that many matrices in all (their all-gather reaches every rank). None: one
            batch per bucket.

    Last, consecutive latency-bound batches become waves that share their collectives
    (``coalesce``): a profile whose latency is 0 makes none.
    """
    if row_assignment not in ROW_ASSIGNMENTS:
        raise ValueError(f"row_assignment must be one of {ROW_ASSIGNMENTS}, got {row_assignment!r}")
    if remainder_path not in REMAINDER_PATHS:
        raise ValueError(f"remainder_path must be one of {REMAINDER_PATHS}, got {remainder_path!r}")
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if len(configs) != len(specs):
        raise ValueError(f"plan_batches got {len(specs)} specs but {len(configs)} Newton-Schulz configs")
    profile = get_profile(profile or "cpu_gloo")
    planned_specs = [_redundant(s) for s in specs] if strategy == "redundant" else list(specs)
    sources: dict[int, list[int]] = {}
    pieces_plans: dict[bool, dict] = {}  # the pieces planned, shared by the planners of one budget (or none)

    def plan_with(rule: str, move: bool, budget=max_local_matrices) -> Plan:
        return RulePlanner(planned_specs, configs, comm_itemsize=comm_itemsize, remainder_path=remainder_path,
                           profile=profile, row_assignment=rule, rebalance=move,
                           max_local_matrices=budget, sources=sources,
                           pieces_plans=pieces_plans.setdefault(budget is None, {})).plan()

    if row_assignment != "best":
        return coalesce(plan_with(row_assignment, rebalance is not False), profile)
    moves = (True, False) if rebalance is None else (rebalance,)
    choices = [(rule, move) for rule in ROW_RULES for move in moves]
    # The rule is chosen on the plans without the budget, then planned again with it: under one
    # rule a budget only cuts batches (owners are placed before any cut), so a plan's owners, and
    # the bytes they move, do not follow workspace_bytes, and the setting a memory refusal names
    # changes nothing else.
    options = [plan_with(rule, move, None) for rule, move in choices]
    largest = max((ns_flops(s.matrix_shape, c) for s, c in zip(specs, configs)), default=0)
    # balance first (anything within 10% of perfect counts as balanced), then modelled time; the
    # time (a replay of the pipeline over every rank) is modelled only for the best-balanced plans
    balance = [max(_imbalance(p, largest), 1.1) for p in options]
    tied = [k for k, b in enumerate(balance) if b == min(balance)]
    best = min(tied, key=lambda k: step_seconds(options[k], profile))
    plan = options[best] if max_local_matrices is None else plan_with(*choices[best])
    return coalesce(plan, profile)


def _imbalance(plan: Plan, largest_matrix_flops: int) -> float:
    """Max-rank FLOPs / max(mean, largest single matrix), per global rank."""
    loads = flops_per_rank(plan)
    target = max(sum(loads) / max(len(loads), 1), largest_matrix_flops) or 1
    return max(loads, default=0) / target


def _redundant(spec: MatrixSpec) -> MatrixSpec:
    if spec.layout in ("row_shard", "blocks"):
        return replace(spec, layout="gather_all")
    if spec.layout == "replicated":
        return replace(spec, layout="whole", group=None, rows=())
    return spec
