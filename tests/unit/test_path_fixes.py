"""Path and planner fixes found by the audit of the communication paths: where a rank with no
input makes its buffers, and sub-group banks of different expert counts kept apart."""

import torch

from muonlab.comm.paths import owner
from muonlab.comm.paths.base import PathContext
from muonlab.comm.paths.subgroup import ranks_per_expert
from muonlab.comm.records import BatchPlan
from muonlab.comm.specs import GroupKey
from muonlab.kernels.config import NSConfig
from muonlab.simulate import simulate


def test_a_rank_that_owns_nothing_sends_from_the_ranks_device(monkeypatch):
    """Under NCCL a CPU tensor can't join the all-gather: the non-owner's empty buffer must sit on
    the device of the owner's (the meta device stands in for cuda:r here)."""
    seen = {}

    class Stop(Exception):
        pass

    def record(send, sizes, *, group, group_rank):
        seen[group_rank] = send.device
        raise Stop

    monkeypatch.setattr(owner, "all_gather", record)
    group = GroupKey(mesh_ranks=(0, 1), mesh_shape=(2,), axis_name="")
    batch = BatchPlan(index=0, path="owner", names=("w",), param_indices=(0,), matrix_shape=(4, 3),
                      num_matrices=1, group=group, ns_config=NSConfig(), ranks=(0, 1), owners=(0,),
                      bytes_sent=(48, 0), bytes_recv=(0, 48), flops=(1, 0), param_shapes=((4, 3),))
    device = torch.device("meta")
    for rank, inputs in ((0, [torch.empty(4, 3, device=device)]), (1, [None])):
        run = owner.run(batch, inputs, PathContext(None, rank, torch.bfloat16, device))
        mats = next(run)
        try:
            run.send(None if mats is None else torch.empty(1, 4, 3, device=device))
        except Stop:
            pass
    assert seen == {0: device, 1: device}


def test_sub_group_banks_of_different_expert_counts_are_planned_apart():
    """Banks of 2 and 3 experts of one matrix shape on 6 ranks: sub-groups of 3 and of 2 ranks.
    In one batch the path took one sub-group size for both and the step crashed."""
    plan = simulate([("e2", (12, 4)), ("e3", (18, 4))], 6, fused_banks={"e2": 2, "e3": 3})
    batches = {b.names: b for b in plan if b.path == "subgroup"}
    assert sorted(batches) == [("e2",), ("e3",)], [(b.path, b.names) for b in plan]
    assert ranks_per_expert(batches[("e2",)]) == 3 and ranks_per_expert(batches[("e3",)]) == 2
