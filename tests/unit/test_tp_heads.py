"""What ``specs.tp_whole_blocks`` relies on, from global metadata alone: under a column-wise TP split
with FSDP2 inside it (``(_StridedShard(0, T), Shard(0))``), the rank at (dp d, tp t) holds rows
``torch.chunk`` d of TP slice t, all columns, so each TP slice is a bank row-sharded over dp alone.
The real DTensors are checked on 4 gloo ranks (tests/distributed/test_tensor_parallel.py)."""

import pytest
from torch.distributed.tensor import Shard
from torch.distributed.tensor.placement_types import _StridedShard

from muonlab.comm.specs import chunk_sizes, held_piece


@pytest.mark.parametrize("rows, cols, dp, tp", [(16, 16, 2, 2), (8, 16, 2, 2), (24, 8, 3, 2), (12, 6, 4, 3),
                                                (8, 4, 4, 2)])
def test_each_tp_slice_is_a_row_sharded_bank_over_dp(rows, cols, dp, tp):
    placements = (_StridedShard(0, split_factor=tp), Shard(0))
    slice_rows = rows // tp
    sizes = chunk_sizes(slice_rows, dp)
    for d in range(dp):
        for t in range(tp):
            got = held_piece((rows, cols), (dp, tp), (d, t), placements)
            start = t * slice_rows + sum(sizes[:d])
            assert got == ((((start, sizes[d]),) if sizes[d] else ()), ((0, cols),)), (d, t, got)

