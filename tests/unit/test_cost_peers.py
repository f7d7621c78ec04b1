"""comm_seconds splits each rank's bytes by where ITS peers sit (cost.py), not by one node-major guess.

Every expected value is the alpha-beta formula written out:
    collectives * latency + max over ranks of max(traffic * intra / intra_bw, traffic * (1 - intra) / inter_bw)
with traffic = max(bytes sent, bytes received) and intra = the share of the rank's peers on its node.
"""

import pytest

from muonlab.comm.cost import PROFILES, HardwareProfile, comm_seconds
from muonlab.comm.paths import PATHS
from muonlab.comm.records import BatchPlan
from muonlab.comm.specs import GroupKey
from muonlab.kernels.config import NSConfig
from muonlab.simulate import simulate

H100 = PROFILES["h100_node"]


def alpha_beta(batch, profile, intra_of_rank):
    """The formula, with ``intra_of_rank[r]``: the intra-node shares of group-local rank r's peers."""
    worst = 0.0
    for r, shares in intra_of_rank.items():
        traffic = max(batch.bytes_sent[r], batch.bytes_recv[r])
        for intra in shares:
            worst = max(worst, traffic * intra / profile.intra_bw, traffic * (1 - intra) / profile.inter_bw)
    return PATHS[batch.path].collectives * profile.latency_s + worst


def moving_batch(plan, path=None):
    return next(b for b in plan if any(b.bytes_sent) and (path is None or b.path == path))


@pytest.mark.parametrize("world, experts, intra", [
    (16, 2, 1.0),       # sub-groups of 8 are whole nodes: nothing leaves a node
    (32, 2, 7 / 15),    # sub-groups of 16 span two nodes: 7 of a rank's 15 peers share its node
])
def test_subgroup_batch_is_priced_over_its_sub_group_only(world, experts, intra):
    """The subgroup path all-gathers inside sub-groups of k = W / E ranks; the old model spread
    the bytes over all W - 1 ranks of the group (16 ranks, E=2: 4.1x too slow)."""
    plan = simulate([("bank", (experts * 4096, 4096))], world, fused_banks={"bank": experts}, profile=H100)
    b = moving_batch(plan, "subgroup")
    want = alpha_beta(b, H100, {r: [intra] for r in range(world)})
    assert comm_seconds(b, H100) == pytest.approx(want, rel=1e-12)


def test_strided_expert_axis_is_priced_off_node():
    """On a (4, 8) expert mesh the fsdp axis' slices are {r, r+8, r+16, r+24}: with 8 ranks per
    node every peer is on another node, where the old model priced all bytes at intra_bw."""
    plan = simulate([("w_in", (48, 1024, 512)), ("w_out", (48, 512, 1024))], (4, 8), profile=H100)
    b = moving_batch(plan)
    assert b.group.axis_slices()[0] == [0, 8, 16, 24]
    want = alpha_beta(b, H100, {r: [0.0] for r in range(4)})
    assert comm_seconds(b, H100) == pytest.approx(want, rel=1e-12)


def test_ranks_of_a_partial_node_use_their_own_local_peers():
    """12 contiguous ranks, 8 per node: ranks 0-7 have 7 local peers of 11, ranks 8-11 only 3."""
    plan = simulate([(f"w{i}", (1024, 1024)) for i in range(12)], 12, profile=H100)
    b = moving_batch(plan)
    want = alpha_beta(b, H100, {r: [7 / 11 if r < 8 else 3 / 11] for r in range(12)})
    assert comm_seconds(b, H100) == pytest.approx(want, rel=1e-12)


def test_a_local_rank_standing_for_differently_placed_ranks_takes_the_worst_split():
    """Axis 1 of a (3, 4) mesh with 6 ranks per node: slice [0..3] is on one node, slice [4..7]
    straddles two (each rank 1 local peer of 3). Local rank r stands for both, so it is priced
    at both splits and the slower counts."""
    profile = HardwareProfile(name="six", intra_bw=100e9, inter_bw=10e9, ranks_per_node=6, latency_s=1e-5,
                              matmul_flops=1e12)
    group = GroupKey(mesh_ranks=tuple(range(12)), mesh_shape=(3, 4), axis_name="x", axis_index=1)
    sent = (4000, 4000, 4000, 8000)
    b = BatchPlan(index=0, path="all_to_all", names=("w",), param_indices=(0,), matrix_shape=(8, 8),
                  num_matrices=4, group=group, ns_config=NSConfig(), ranks=(0, 1, 2, 3),
                  bytes_sent=sent, bytes_recv=sent, flops=(1, 1, 1, 1))
    want = alpha_beta(b, profile, {r: [1.0, 1 / 3, 1.0] for r in range(4)})  # slice [8..11] is node 1's alone
    assert want == pytest.approx(PATHS["all_to_all"].collectives * 1e-5 + 8000 * (2 / 3) / 10e9)
    assert comm_seconds(b, profile) == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("world", [4, 8, 16, 32])
def test_contiguous_groups_on_whole_nodes_keep_the_node_major_price(world):
    """The common case is unchanged: the world group on h100_node (a group within one node, or
    whole nodes of 8) splits every rank's bytes (min(8, W) - 1) / (W - 1) intra-node."""
    plan = simulate([(f"w{i}", (1024, 1024)) for i in range(world)], world, profile=H100)
    b = moving_batch(plan)
    intra = (min(H100.ranks_per_node, world) - 1) / (world - 1)
    want = alpha_beta(b, H100, {r: [intra] for r in range(world)})
    assert comm_seconds(b, H100) == pytest.approx(want, rel=1e-12)


def test_a_group_inside_one_node_away_from_rank_0_is_all_intra_node():
    """Ranks 8..15 (a process group on the second node) send everything over NVLink."""
    group = GroupKey(mesh_ranks=tuple(range(8, 16)), mesh_shape=(8,), axis_name="")
    sent = tuple(1000 * (r + 1) for r in range(8))
    b = BatchPlan(index=0, path="all_to_all", names=("w",), param_indices=(0,), matrix_shape=(8, 8),
                  num_matrices=8, group=group, ns_config=NSConfig(), ranks=tuple(range(8)),
                  bytes_sent=sent, bytes_recv=sent, flops=(1,) * 8)
    want = PATHS["all_to_all"].collectives * H100.latency_s + 8000 / H100.intra_bw
    assert comm_seconds(b, H100) == pytest.approx(want, rel=1e-12)


def test_a_batch_without_a_group_keeps_the_node_major_guess():
    sent = (3000, 1000, 2000, 500, 0, 0, 0, 0, 0, 0, 0, 0)
    b = BatchPlan(index=0, path="all_to_all", names=("w",), param_indices=(0,), matrix_shape=(8, 8),
                  num_matrices=1, group=None, ns_config=NSConfig(), ranks=tuple(range(12)),
                  bytes_sent=sent, bytes_recv=sent, flops=(1,) * 12)
    want = alpha_beta(b, H100, {r: [7 / 11] for r in range(12)})
    assert comm_seconds(b, H100) == pytest.approx(want, rel=1e-12)
