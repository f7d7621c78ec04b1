"""muonlab.optim.nonfinite across gloo ranks: DTensor grads, every rank agrees on the bad ranks."""

import pytest

from muonlab.distributed import launch

from . import _workers_nonfinite as W


@pytest.mark.timeout(300)
def test_dtensor_grads_nonfinite_on_the_last_rank_only():
    world = 3
    results = launch(W.check_dtensor_grads, world, timeout_s=240)
    last = world - 1
    for rank, out in results.items():
        for dtype in ("torch.float32", "torch.bfloat16"):
            assert out[f"clean_{dtype}"] == ([], []), (rank, dtype)
            assert out[f"nan_{dtype}"] == ([last], ["g2"] if rank == last else []), (rank, dtype)
        if rank in (0, last):
            assert out["subgroup"] == ([last], ["grad 0 of shape (3,)"] if rank == last else []), rank
        else:
            assert "subgroup" not in out
