"""Turn a batch's bytes and FLOPs into modelled seconds under a hardware profile.

The model is deliberately small (an alpha-beta model per collective plus a matmul rate):

    comm(batch)    = collectives x latency + max over ranks of
                     max(intra-node bytes / intra_bw, inter-node bytes / inter_bw)
    compute(batch) = per-rank Newton-Schulz FLOPs / matmul rate
    step           = the engine's pipeline replayed with these times (see step_seconds)

Bytes leaving a rank are split between intra- and inter-node links in proportion to how many of
the group's other ranks share its node (the group is assumed laid out node-major).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from .paths import PATHS
from .records import BatchPlan, group_rank_maps


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


def comm_seconds(batch: BatchPlan, profile: HardwareProfile) -> float:
    size = len(batch.bytes_sent) or 1
    if size <= 1 or not any(batch.bytes_sent):
        return 0.0
    peers = size - 1
    local_peers = min(profile.ranks_per_node, size) - 1
    intra_frac = local_peers / peers
    worst = 0.0
    for sent, recv in set(zip(batch.bytes_sent, batch.bytes_recv)):  # ranks mostly repeat a few pairs
        traffic = max(sent, recv)
        worst = max(worst, max(traffic * intra_frac / profile.intra_bw, traffic * (1 - intra_frac) / profile.inter_bw))
    return PATHS[batch.path].collectives * profile.latency_s + worst


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

