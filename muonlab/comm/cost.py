"""Turn a batch's bytes and FLOPs into modelled seconds under a hardware profile.

The model is deliberately small (an alpha-beta model per collective plus a matmul rate):

    comm(batch)    = collectives x latency (once per wave: see planner/coalesce.py) + max over ranks of
                     max(intra-node bytes / intra_bw, inter-node bytes / inter_bw)
                     + the update rule's all-reduce, if it has one (NorMuon's norms: rule_seconds)
    compute(batch) = per-rank Newton-Schulz FLOPs / matmul rate
    step           = the engine's pipeline replayed with these times (see step_seconds)

Bytes leaving a rank are split between intra- and inter-node links in proportion to how many of
its peers (the ranks it exchanges with) share its node; see ``comm_seconds``.
"""

from __future__ import annotations

import functools
import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from .paths import PATHS
from .records import BatchPlan, group_rank_maps
from .specs import GroupKey


PHASES = ("momentum", "comm", "newton_schulz", "update", "rule")
"""The phases of a batch the model prices (``predict_phases``), in the order a step runs them."""
HOST_PHASES = ("momentum", "newton_schulz", "update", "between")
"""Phases with a host cost (``HardwareProfile.host_s``); "between": a batch's host work outside its
phases' spans (taking its inputs, stacking, packing for its path), priced in the step alone."""


@dataclass(frozen=True, kw_only=True)
class HardwareProfile:
    """Link and compute rates of one rank."""

    name: str
    """Short name used in tables."""
    intra_bw: float
    """Bytes/s one rank can send to ranks on its own node."""
    inter_bw: float
    """Bytes/s one rank can send to other nodes."""
    ranks_per_node: int
    """Ranks sharing the fast intra-node links."""
    latency_s: float
    """Fixed cost of one collective call."""
    matmul_flops: float
    """Dense matmul rate (FLOP/s) in the Newton-Schulz dtype."""
    source: str = ""
    """Where the numbers come from."""
    date: str = ""
    """When they were measured (ISO 8601; empty for datasheet figures)."""
    mem_bw: float = 10e9
    """Bytes/s of the elementwise phases (momentum, update) on one rank."""
    matmul_rates: tuple[tuple[str, str, float], ...] = ()
    """Measured Newton-Schulz rates ``(dtype, shape class, FLOP/s)`` (``shape_class``: size and
    form); a pair not listed falls back to the size alone, then to ``matmul_flops``."""
    host_s: tuple[tuple[str, float, float], ...] = ()
    """Host cost of each phase of a batch, ``(phase, seconds per batch, seconds per matrix)``
    (dispatching its tensor operations: what a phase of small matrices costs); none listed: 0."""
    host_s_per_call: float = 0.0
    """Host cost of issuing one collective call, beyond ``latency_s``."""

    def __post_init__(self):
        # a zero rate divided by later, a negative latency gave negative modelled seconds
        rates = (("intra_bw", self.intra_bw), ("inter_bw", self.inter_bw), ("matmul_flops", self.matmul_flops))
        for field, value in rates + (("latency_s", self.latency_s),):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"HardwareProfile {self.name!r}: {field} must be a finite number, got {value!r}")
        for field, value in rates:
            if value <= 0:
                raise ValueError(f"HardwareProfile {self.name!r}: {field} must be > 0, got {value!r}")
        if self.latency_s < 0:
            raise ValueError(f"HardwareProfile {self.name!r}: latency_s must be >= 0, got {self.latency_s!r}")
        for field, value in (("mem_bw", self.mem_bw), *((f"matmul_rates[{d}, {c}]", r) for d, c, r in self.matmul_rates)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or not math.isfinite(value):
                raise ValueError(f"HardwareProfile {self.name!r}: {field} must be a finite number > 0, got {value!r}")
        for field, value in (("host_s_per_call", self.host_s_per_call),
                             *((f"host_s[{p}]", v) for p, *vs in self.host_s for v in vs)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 or not math.isfinite(value):
                raise ValueError(f"HardwareProfile {self.name!r}: {field} must be a finite number >= 0, got {value!r}")
        unknown = sorted({p for p, *_ in self.host_s} - set(HOST_PHASES))
        if unknown:
            raise ValueError(f"HardwareProfile {self.name!r}: host_s names phases {unknown}; they are {list(HOST_PHASES)}")
        if isinstance(self.ranks_per_node, bool) or not isinstance(self.ranks_per_node, int) or self.ranks_per_node < 1:
            raise ValueError(f"HardwareProfile {self.name!r}: ranks_per_node must be an int >= 1, "
                             f"got {self.ranks_per_node!r}")


PROFILES = {
    # NVIDIA H100 SXM: NVLink 4 at 900 GB/s bidirectional per GPU (450 GB/s each way), one
    # ConnectX-7 NDR 400 Gb/s (50 GB/s) InfiniBand port per GPU, 989 TFLOP/s dense bf16 (H100
    # datasheet). Latency ~15 us per NCCL collective is an order of magnitude, not a measurement.
    "h100_node": HardwareProfile(
        name="h100_node", intra_bw=450e9, inter_bw=50e9, ranks_per_node=8, latency_s=15e-6,
        matmul_flops=989e12 * 0.6, mem_bw=3.35e12 * 0.7,
        source="H100 SXM datasheet: NVLink4 450 GB/s/direction, NDR IB 50 GB/s, 989 TFLOP/s bf16 (x0.6 achievable), "
               "HBM3 3.35 TB/s (x0.7 achievable)",
    ),
    # This project's 2-core CPU machines with gloo over loopback, measured by
    # benchmarks/bench_planner.py --measure (see benchmarks/results/planner.md).
    "cpu_gloo": HardwareProfile(
        name="cpu_gloo", intra_bw=1.0e9, inter_bw=1.0e9, ranks_per_node=64, latency_s=200e-6,
        matmul_flops=40e9,
        source="measured on the 2-core CPU machine: gloo all_to_all_single bf16 ~1 GB/s, bf16 matmul ~40 GFLOP/s "
               "(elementwise 10 GB/s and no host cost: orders of magnitude, not measurements; muonlab.calibrate "
               "measures all of them)",
    ),
}


def get_profile(profile: str | HardwareProfile) -> HardwareProfile:
    if isinstance(profile, HardwareProfile):
        return profile
    if profile not in PROFILES:
        raise ValueError(f"unknown hardware profile {profile!r}; choose one of {sorted(PROFILES)}")
    return PROFILES[profile]


def _latency(batch: BatchPlan, profile: HardwareProfile) -> float:
    """Its collectives' fixed cost; a batch of a wave after the first shares the wave's."""
    return PATHS[batch.path].collectives * profile.latency_s if batch.pays_latency else 0.0


def rule_seconds(batch: BatchPlan, profile: HardwareProfile) -> float:
    """Its update rule's all-reduce (``BatchPlan.rule_sums`` fp32 numbers over its group; NorMuon's
    norms): one collective's latency, and a ring's 2 (W - 1) / W of the bytes at the slower link.
    Counted with the batch's communication: an upper bound, as the run issues it async and
    applies the batch once the next one is back (muonlab.optim.rule_step)."""
    if not batch.rule_sums or batch.group is None or batch.group.size <= 1:
        return 0.0
    world = batch.group.size
    link = profile.inter_bw if world > profile.ranks_per_node else profile.intra_bw
    return profile.latency_s + 2 * (world - 1) / world * 4 * batch.rule_sums / link


def comm_seconds(batch: BatchPlan, profile: HardwareProfile) -> float:
    """Modelled seconds of a batch's communication: its path's ``collectives x latency`` plus the
    slowest rank (below), and its update rule's all-reduce where it has one (``rule_seconds``).

    A group-local rank r moves ``traffic = max(bytes_sent[r], bytes_recv[r])``. Its PEERS are the
    ranks it exchanges with: the other members of its slice of the batch's group axis (global
    ranks from ``GroupKey.axis_slices``), or, on a path that says so (``CommPath.ranks_reached``:
    the subgroup path's sub-group of ``ranks_per_expert`` ranks), that many of them. With
    ``intra = peers on its node / peers`` (node = global rank // ranks_per_node) the rank takes
    ``max(traffic * intra / intra_bw, traffic * (1 - intra) / inter_bw)``. A group-local rank
    stands for one global rank per slice, and slices may sit differently on nodes (a strided
    axis), so each of its splits is priced and the worst over all of them is the batch's.
    A batch without a group keeps the old node-major guess: (min(ranks_per_node, n) - 1) / (n - 1)
    of every rank's bytes intra-node, n = its number of per-rank entries.
    """
    return _paths_seconds(batch, profile) + rule_seconds(batch, profile)


def _paths_seconds(batch: BatchPlan, profile: HardwareProfile) -> float:
    """``comm_seconds`` of the path's own collectives."""
    size = len(batch.bytes_sent) or 1
    if size <= 1 or not any(batch.bytes_sent):
        return 0.0
    if batch.group is None:
        intra_frac = (min(profile.ranks_per_node, size) - 1) / (size - 1)
        classes = [((intra_frac,), range(size))]
    else:
        reached = PATHS[batch.path].ranks_reached if batch.path in PATHS else None
        span = reached(batch) if reached is not None else batch.group.size
        classes = _intra_classes(batch.group, span, profile.ranks_per_node)
    sent, recv = batch.bytes_sent, batch.bytes_recv
    if len(sent) != len(recv):  # priced pairwise, as zip pairs them
        sent, recv = sent[:len(recv)], recv[:len(sent)]
    size = len(sent)
    worst = 0.0
    for fracs, ranks in classes:
        # pricing grows with traffic, so a class's busiest rank is the only one that can be worst; its
        # traffic is max(most sent, most received), found without a Python step per rank where the
        # class is every rank (the common case, thousands of ranks in a simulation)
        if len(ranks) == size and ranks[-1] == size - 1:
            traffic = max(max(sent, default=0), max(recv, default=0))
        else:
            ranks = [r for r in ranks if r < size]
            traffic = max(max(map(sent.__getitem__, ranks), default=0), max(map(recv.__getitem__, ranks), default=0))
        if not traffic:
            continue
        for intra in fracs:
            worst = max(worst, traffic * intra / profile.intra_bw, traffic * (1 - intra) / profile.inter_bw)
    return _latency(batch, profile) + worst


@functools.lru_cache(maxsize=256)
def _intra_classes(group: GroupKey, span: int, ranks_per_node: int
                   ) -> tuple[tuple[tuple[float, ...], tuple[int, ...]], ...]:
    """Group-local ranks grouped by their intra-node shares: ((shares, local ranks), ...).

    Peers of the rank at position p of a slice are the other ranks of the slice's run of ``span``
    ranks holding p (the whole slice when span is the group size). A local rank gets one share per
    distinct layout of its slices. Cached: the planner prices thousands of options on a few groups,
    and counting members per node keeps a first call O(ranks) even for the world group.
    """
    shares: list[set[float]] = [set() for _ in range(group.size)]
    for members in group.axis_slices():
        for start in range(0, len(members), span):
            sub = members[start:start + span]
            if len(sub) < 2:
                continue  # no peer, so nothing to send (a lone rank's bytes would be a planner bug)
            per_node = Counter(g // ranks_per_node for g in sub)
            for pos, g in enumerate(sub, start):
                shares[pos].add((per_node[g // ranks_per_node] - 1) / (len(sub) - 1))
    by_shares: dict[tuple[float, ...], list[int]] = {}
    for r, s in enumerate(shares):
        if s:
            by_shares.setdefault(tuple(sorted(s)), []).append(r)
    return tuple((s, tuple(ranks)) for s, ranks in by_shares.items())


def compute_seconds(batch: BatchPlan, profile: HardwareProfile) -> float:
    return max(batch.flops, default=0) / profile.matmul_flops


def batch_seconds(batch: BatchPlan, profile: HardwareProfile) -> float:
    return max(comm_seconds(batch, profile), compute_seconds(batch, profile))


def step_seconds(plan: Iterable[BatchPlan], profile: HardwareProfile) -> float:
    """Modelled optimizer time of the Muon part of one step, following the engine's pipeline.

    The engine issues batch i+1's collective before computing batch i, so batch i's data is
    complete once every rank has finished batch i-2 and the transfer took its time:
        arrive(i) = max over ranks of done_r(i-2) + out(i)
        done_r(i) = max(done_r(i-1), arrive(i)) + compute_r(i)
    and the step ends when the last rank is done and the last way back has landed, but never
    before the links could carry all of the bytes. Newton-Schulz is the only compute here: the
    planner's view, which trades bytes against FLOPs; ``predict_phases`` replays every phase of the
    engine's schedule.
    """
    batches = list(plan)
    if not batches:
        return 0.0
    index = group_rank_maps(batches)
    world = max((max(m) + 1 for m in index.values() if m), default=1)
    done = [[0.0] * world, [0.0] * world]  # done after batch i-2, after batch i-1
    total_comm = 0.0
    last_back = 0.0
    for b in batches:
        comm = comm_seconds(b, profile)
        total_comm += comm
        share = PATHS[b.path].out_share
        arrive = max(done[0]) + share * comm
        local = index[b.group]
        # each group-local rank's compute once, then per global rank (thousands in a simulation)
        per_local = [f / profile.matmul_flops for f in b.flops]
        work = [per_local[r] if r is not None and r < len(per_local) else 0.0 for r in map(local.get, range(world))]
        now = [max(d, arrive) + w for d, w in zip(done[1], work)]
        done = [done[1], now]
        last_back = (1 - share) * comm
    return max(max(done[1]) + last_back, total_comm)


# ---------------------------------------------------------------- every phase of a batch

MOMENTUM_PASSES = 5
"""fp32 passes over a rank's elements in the momentum (read gradient and buffer, write the buffer,
read it again and write the Nesterov output)."""
UPDATE_PASSES = 3
"""Passes in the update (read the parameter and the orthogonalized matrix, write the parameter)."""
SHAPE_CLASSES = ((64, "small"), (512, "medium"), (math.inf, "large"))
"""A matrix's class by its smaller side: at most 64, at most 512, larger (matmul rates differ by
an order of magnitude between them, kernel launches dominating the small ones)."""


def shape_class(shape: tuple[int, int], form: str | None = None) -> str:
    """``SHAPE_CLASSES``'s name for a matrix of this shape, with "/<form>" for a Newton-Schulz form
    other than plain (the gram form's products have other shapes, so another rate)."""
    side = min(shape)
    size = next(name for bound, name in SHAPE_CLASSES if side <= bound)
    return size if form in (None, "plain") else f"{size}/{form}"


def matmul_rate(profile: HardwareProfile, dtype: str | None, shape: tuple[int, int], form: str | None = None) -> float:
    """FLOP/s of Newton-Schulz on ``shape`` in ``dtype`` ("float32", "bfloat16", ...) and ``form``:
    the profile's measured rate of that class (``matmul_rates``), else of its size in the plain
    form, else ``matmul_flops``."""
    rates = {(d, c): rate for d, c, rate in profile.matmul_rates}
    return rates.get((dtype, shape_class(shape, form)), rates.get((dtype, shape_class(shape)), profile.matmul_flops))


def host_seconds(profile: HardwareProfile, phase: str, num_matrices: int) -> float:
    """The profile's host cost of ``phase`` on a batch of ``num_matrices`` matrices (``host_s``)."""
    for p, per_batch, per_matrix in profile.host_s:
        if p == phase:
            return per_batch + per_matrix * num_matrices
    return 0.0


def held_elements(batch: BatchPlan, rank: int) -> tuple[int, int]:
    """(elements, matrices) of the batch's parameters that group-local ``rank`` holds (what its
    momentum and update touch)."""
    shapes = batch.param_shapes or ((batch.num_matrices, *batch.matrix_shape),)
    mat = math.prod(batch.matrix_shape)
    if batch.group is None or batch.group.size <= 1:
        n = sum(math.prod(s) for s in shapes)
    elif batch.rows and rank < len(batch.rows):
        n = sum(batch.rows[rank] * math.prod(s) // max(1, s[batch.shard_dim]) for s in shapes if len(s) > batch.shard_dim)
    elif batch.sources:
        n = mat * sum(src.count(rank) for src in batch.sources)
    else:
        n = sum(math.prod(s) for s in shapes) // batch.group.size
    return n, -(-n // mat) if mat else 0


def predict_phases(plan: Iterable[BatchPlan], profile: HardwareProfile, rank: int = 0,
                   ns_choices: dict[int, dict] | None = None) -> list[dict]:
    """The model's seconds of every phase of each batch on global ``rank``, as the step's spans
    measure them: one dict per batch with ``batch``, ``path``, ``momentum``, ``newton_schulz``,
    ``update`` (host cost, plus elements over ``mem_bw`` or FLOPs over ``matmul_rate``), ``transfer``
    (``comm_seconds``: the links' time), ``comm`` (the time its collectives are in flight, from
    issue to the end of the wait, as its comm spans run), ``exposed_comm`` (the part of that in
    which the rank computes nothing), ``rule`` (``rule_seconds``) and ``step`` (the timeline's end
    on the slowest rank, the same in every row). Phases are 0.0 where the batch has none on this
    rank. ``ns_choices``: batch index -> the Newton-Schulz "dtype" and "form" that run (the rows of
    ``Muon.resolved_choices()``), for the profile's measured rates; without them ``matmul_flops``.
    See ``_timeline`` for the schedule."""
    batches = list(plan)
    if not batches:
        return []
    ns_choices = ns_choices or {}
    index = group_rank_maps(batches)
    world = max((max(m) + 1 for m in index.values() if m), default=1)
    if not 0 <= rank < world:
        raise ValueError(f"rank={rank} is outside the plan's ranks 0..{world - 1}")

    def phases_of(b: BatchPlan, r: int) -> dict:
        elems, mats = held_elements(b, r)
        flops = b.flops[r] if r < len(b.flops) else 0
        out = dict(momentum=0.0, newton_schulz=0.0, update=0.0)
        if elems:
            out["momentum"] = host_seconds(profile, "momentum", mats) + MOMENTUM_PASSES * 4 * elems / profile.mem_bw
            out["update"] = host_seconds(profile, "update", mats) + UPDATE_PASSES * 4 * elems / profile.mem_bw
        if flops:
            per_matrix = sum(b.flops) / max(1, b.num_matrices)  # every matrix orthogonalized once
            out["newton_schulz"] = (host_seconds(profile, "newton_schulz", max(1, round(flops / per_matrix)))
                                    + flops / matmul_rate(profile, *_dtype_form(ns_choices, b)))
        return out

    # per batch (by identity) and group-local rank: a plan has few groups and ranks per batch
    phases = {id(b): {r: phases_of(b, r) for r in set(index[b.group].values())} for b in batches}
    step, comm, exposed = _timeline(batches, profile, index, world, phases)
    rows = []
    for b in batches:
        local = _local(index, b, rank)
        mine = phases[id(b)][local] if local is not None else dict(momentum=0.0, newton_schulz=0.0, update=0.0)
        rows.append(dict(batch=b.index, path=b.path, **mine, transfer=comm_seconds(b, profile),
                         comm=comm[id(b)][rank], exposed_comm=exposed[id(b)][rank], rule=rule_seconds(b, profile),
                         step=step))
    return rows


def _dtype_form(ns_choices: dict, b: BatchPlan) -> tuple:
    choice = ns_choices.get(b.index, {})
    return choice.get("dtype"), b.matrix_shape, choice.get("form")


def _local(index: dict, b: BatchPlan, g: int) -> int | None:
    """Global rank ``g``'s index in the batch's group; a batch of no group runs on every rank alone."""
    return 0 if b.group is None else index[b.group].get(g)


def _timeline(batches: list[BatchPlan], profile: HardwareProfile, index: dict, world: int, phases: dict
              ) -> tuple[float, dict, dict]:
    """Every rank's step replayed in the engine's order (``muonlab.comm.engine.execute_plan``):

        start(0); for each run i: start(i+1) if its path sends out first; compute(i); finish(i-1);
        start(i+1) if not yet; then finish(last)

    A run is a batch, or the batches of one wave (``BatchPlan.travels_with``). start: each batch's
    momentum, its host work outside the phases (``host_s`` "between") and the issue of its way out
    (``host_s_per_call`` per collective). compute: wait for the way out, Newton-Schulz, issue the
    way back (or update, on a path without one). finish: wait for the way back (and the rule's
    all-reduce), update. A way lands when the last rank of the batch's group has issued it plus
    its share (``out_share``) of the transfer (``comm_seconds``; a wave's add up).

    Returns (the latest rank's end, {id(batch): [seconds in flight per global rank]}, {id(batch):
    [seconds of that no compute covers]}): what ``muonlab.comm.plan_vs_run`` measures from spans.
    """
    from ..trace.step_time import intersection, merge, total  # the measured side's own interval arithmetic

    runs: list[list[BatchPlan]] = []
    for b in batches:
        if b.travels_with is not None and not b.pays_latency and runs:
            runs[-1].append(b)
        else:
            runs.append([b])
    clock = [0.0] * world
    compute: list[list[tuple[float, float]]] = [[] for _ in range(world)]
    flight = {id(b): [[] for _ in range(world)] for b in batches}  # (issue, end of wait) per rank
    issued: dict = {}  # (id(batch), "out" | "back", rank) -> issue time

    def members(run):
        return [g for g in range(world) if _local(index, run[0], g) is not None]

    def work(b, g, phase) -> float:
        return phases[id(b)][_local(index, b, g)][phase]

    def run_phase(b, g, phase) -> None:
        t = work(b, g, phase)
        if t:
            compute[g].append((clock[g], clock[g] + t))
            clock[g] += t

    def issue(run, way: str) -> None:
        # one collective a way (a wave's members share it); a path without a way out issues none there
        calls = 1 if (way == "back" or PATHS[run[0].path].out_share > 0) and PATHS[run[0].path].collectives else 0
        for g in members(run):
            clock[g] += calls * profile.host_s_per_call
            for b in run:
                issued[(id(b), way, g)] = clock[g]

    def land(run, way: str) -> None:
        ranks = members(run)
        share = PATHS[run[0].path].out_share
        transfer = sum((share if way == "out" else 1 - share) * comm_seconds(b, profile) for b in run)
        if way == "back":
            transfer += max(rule_seconds(b, profile) for b in run)
        at = max(issued[(id(run[0]), way, g)] for g in ranks) + transfer
        for g in ranks:
            clock[g] = max(clock[g], at)
            for b in run:
                flight[id(b)][g].append((issued[(id(b), way, g)], clock[g]))

    def has_back(run) -> bool:
        path = PATHS[run[0].path]
        return path.collectives > 0 and path.out_share < 1

    started, done = set(), set()

    def start(k: int) -> None:
        started.add(k)
        for g in members(runs[k]):
            for b in runs[k]:
                run_phase(b, g, "momentum")
                clock[g] += host_seconds(profile, "between", b.num_matrices)
                issued[(id(b), "out", g)] = clock[g]
        issue(runs[k], "out")

    def compute_run(k: int) -> None:
        run = runs[k]
        land(run, "out")
        for g in members(run):
            for b in run:
                run_phase(b, g, "newton_schulz")
        if has_back(run):
            issue(run, "back")
        else:
            for g in members(run):
                for b in run:
                    run_phase(b, g, "update")
            done.add(k)

    def finish(k: int) -> None:
        if k in done:
            return
        land(runs[k], "back")
        for g in members(runs[k]):
            for b in runs[k]:
                run_phase(b, g, "update")
        done.add(k)

    start(0)
    for k in range(len(runs)):
        following = k + 1 if k + 1 < len(runs) else None
        if following is not None and PATHS[runs[following][0].path].out_share > 0:
            start(following)
        compute_run(k)
        if k >= 1:
            finish(k - 1)
        if following is not None and following not in started:
            start(following)
    finish(len(runs) - 1)
    busy = [merge(c) for c in compute]
    comm = {key: [total(merge(iv)) for iv in per_rank] for key, per_rank in flight.items()}
    exposed = {key: [total(merge(iv)) - intersection(merge(iv), busy[g]) for g, iv in enumerate(per_rank)]
               for key, per_rank in flight.items()}
    return max(clock), comm, exposed
