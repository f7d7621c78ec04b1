"""Spectral records of FSDP2 and DDP runs on 2 gloo ranks equal those of one process."""

import math

import pytest

from muonlab.launcher import launch
from muonlab.trace import METRICS

from . import _workers_spectral as W

WORLD = 2
CASES = [("fsdp", "muon"), ("ddp", "muon"), ("ddp", "muon-redundant"), ("fsdp", "adamw")]


@pytest.fixture(scope="module")
def results():
    return launch(W.all_runs, WORLD, CASES, timeout_s=300)


def _assert_same(got, ref, case):
    assert [(r["step"], r["name"]) for r in got] == [(r["step"], r["name"]) for r in ref]
    for g, r in zip(got, ref):
        for metric in METRICS:
            if math.isnan(r[metric]):
                assert math.isnan(g[metric]), (case, g, r)
            else:
                assert math.isclose(g[metric], r[metric], rel_tol=1e-4, abs_tol=1e-7), (case, metric, g, r)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(c))
def test_distributed_records_equal_single_process(results, case):
    assert results[1][case] is None  # gathered on rank 0 only
    got = results[0][case]
    _assert_same(got, W.reference(WORLD, case[1]), case)
    # each matrix recorded once, and the work spread over both ranks
    assert len({(r["step"], r["name"]) for r in got}) == len(got)
    assert {r["rank"] for r in got} == {0, 1}
    if case[1] == "muon":
        assert any(not math.isnan(r["ortho_error"]) for r in got)


@pytest.mark.timeout(600)
def test_uneven_shards_record_what_one_process_records(results):
    got = results[0]["uneven"]
    _assert_same(got, W.uneven_reference(), "uneven")
    assert {r["name"] for r in got} == {n for n, _ in W.UNEVEN} and all(r["ortho_error"] > 0 for r in got)


@pytest.mark.timeout(600)
def test_wide_row_sharded_matrix_costs_about_its_own_size(results):
    """The orthogonality error of a row-sharded (32, 1024) matrix: from its 32 x 32 Gram, as one
    process computes it, for about the matrix's bytes (the 1024 x 1024 Gram was 64 times them)."""
    got = results[0]["wide"]
    _assert_same(got["records"], W.wide_reference(), "wide")
    assert got["records"][0]["ortho_error"] > 0
    matrix_bytes = W.WIDE[0] * W.WIDE[1] * 4
    plain, recorded = got["bytes"]  # a step without the recorder's work, then one with it
    assert recorded - plain <= 3 * matrix_bytes, (plain, recorded, matrix_bytes)


@pytest.mark.timeout(600)
def test_a_rank_that_never_measured_a_weight_starts_cold(results):
    """The recording rank of a replica moved between recorded steps: the new one has no warm
    vector and takes cold_iters products (warm_iters from the seed vector were 9% low)."""
    got = results[0]["moved"]
    rows = [r for r in got["records"] if r["name"] == "1.weight"]
    assert [r["step"] for r in rows] == [1, 2] and rows[0]["rank"] != rows[1]["rank"], rows
    assert math.isclose(rows[1]["weight_sigma"], got["exact"], rel_tol=1e-3), (rows[1], got["exact"])
