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
from .paths.subgroup import ranks_per_expert
from .records import BatchPlan, group_rank_maps
from .specs import GroupKey


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
        if isinstance(self.ranks_per_node, bool) or not isinstance(self.ranks_per_node, int) or self.ranks_per_node < 1:
            raise ValueError(f"HardwareProfile {self.name!r}: ranks_per_node must be an int >= 1, "
                             f"got {self.ranks_per_node!r}")


PROFILES = {
    # NVIDIA H100 SXM: NVLink 4 at 900 GB/s bidirectional per GPU (450 GB/s each way), one
    # ConnectX-7 NDR 400 Gb/s (50 GB/s) InfiniBand port per GPU, 989 TFLOP/s dense bf16 (H100
    # datasheet). Latency ~15 us per NCCL collective is an order of magnitude, not a measurement.
    "h100_node": HardwareProfile(
        name="h100_node", intra_bw=450e9, inter_bw=50e9, ranks_per_node=8, latency_s=15e-6,
        matmul_flops=989e12 * 0.6,
        source="H100 SXM datasheet: NVLink4 450 GB/s/direction, NDR IB 50 GB/s, 989 TFLOP/s bf16 (x0.6 achievable)",
    ),
    # This project's 2-core CPU machines with gloo over loopback, measured by
    # benchmarks/bench_planner.py --measure (see benchmarks/results/planner.md).
    "cpu_gloo": HardwareProfile(
        name="cpu_gloo", intra_bw=1.0e9, inter_bw=1.0e9, ranks_per_node=64, latency_s=200e-6,
        matmul_flops=40e9,
        source="measured on the 2-core CPU machine: gloo all_to_all_single bf16 ~1 GB/s, bf16 matmul ~40 GFLOP/s",
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
    ranks from ``GroupKey.axis_slices``), or on the subgroup path only the other members of its
    sub-group of ``ranks_per_expert`` ranks (cut from the slice as the path cuts it). With
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
        # max(1, ...): a sub-group of no rank (more experts than ranks) is no peer set at all
        span = max(1, ranks_per_expert(batch)) if batch.path == "subgroup" else batch.group.size
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
    before the links could carry all of the bytes.
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

