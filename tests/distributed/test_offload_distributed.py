"""State offload on gloo workers: a step with state in host memory or in the per-rank file is
bit-identical to one with resident state, for FSDP2 (fp32, bf16), the DDP-owner layout and EP;
checkpoints saved with one place load into another exactly.

One launch of 4 ranks runs every case (process start-up dominates).
"""

from __future__ import annotations

import pytest
import torch

from muonlab.launcher import launch

from . import _workers_offload as W

CASES = [("fsdp", "fp32"), ("fsdp", "bf16"), ("ddp", "fp32"), ("ep", "fp32")]


def _equal(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), what
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), f"{what}: {k} differs"


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return launch(W.everything, 4, CASES, str(tmp_path_factory.mktemp("offload")), timeout_s=500)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(c))
def test_offloaded_steps_are_bit_identical_to_resident(results, case):
    for rank, res in results.items():
        ref = res["places"][(*case, None)]
        assert ref["residency"]["offloaded_bytes"] == 0
        for place in ("cpu", "disk"):
            got = res["places"][(*case, place)]
            _equal(ref["params"], got["params"], f"rank {rank} {place} params")
            _equal(ref["state"], got["state"], f"rank {rank} {place} state")
            # between steps nothing of the momentum or moments is on the device
            assert got["residency"]["device_bytes"] == 0 and got["residency"]["offloaded_bytes"] > 0


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", [c for c in CASES if c[1] == "fp32"], ids=lambda c: "-".join(c))
def test_checkpoints_move_between_places_exactly(results, case):
    for rank, res in results.items():
        ref = res["resumed"][(*case, None, None)]
        for saved, loaded in W.RESUMES[1:]:
            got = res["resumed"][(*case, saved, loaded)]
            _equal(ref["params"], got["params"], f"rank {rank} {saved}->{loaded} params")
            _equal(ref["state"], got["state"], f"rank {rank} {saved}->{loaded} state")
            if loaded == "disk":  # loaded into the file, not onto the device
                assert got["loaded_residency"]["device_bytes"] == 0
