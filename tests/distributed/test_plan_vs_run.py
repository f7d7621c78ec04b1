"""plan_vs_run and calibrate on a 2-rank gloo group: one profile on every rank, and every measured
phase (communication included) read from that rank's spans. Structure only: no timed assertion."""

from __future__ import annotations

import statistics

import pytest

from muonlab.launcher import launch
from muonlab.trace.step_time import merge, total

from . import _workers_plan_vs_run as W

STEPS = 3


@pytest.fixture(scope="module")
def results():
    return launch(W.calibrate_and_compare, 2, STEPS, timeout_s=240)


def test_calibrate_gives_every_rank_one_profile_of_the_group(results):
    profiles = [results[r]["profile"] for r in (0, 1)]
    assert profiles[0] == profiles[1]
    p = profiles[0]
    assert "gloo all_to_all_single over 2 ranks" in p["source"] and p["date"]
    assert p["ranks_per_node"] == 2 and p["intra_bw"] == p["inter_bw"] > 0 and p["host_s_per_call"] > 0


def test_calibrate_refuses_a_group_it_cannot_measure(results):
    for r in (0, 1):
        assert results[r]["refused"]["not_a_group"].startswith("TypeError: process_group must be")
    assert "not_a_member" not in results[0]["refused"]  # rank 0 is the group of [0]: it measured
    assert results[1]["refused"]["not_a_member"].startswith("ValueError: process_group does not hold this rank")


def test_every_rank_measures_its_phases_from_its_spans(results):
    for rank in (0, 1):
        res = results[rank]
        assert res["rank"] == rank and res["steps"] == STEPS and res["paths"] == ["all_to_all"]
        spans = res["spans"]
        assert {s["rank"] for s in spans} == {rank}
        phases = {r["phase"] for r in res["rows"]}
        assert {"comm", "exposed_comm", "momentum", "update", "rule"} - phases == {"rule"}  # no rule sums
        for r in res["rows"]:
            assert r["predicted_s"] >= 0 and r["measured_s"] >= 0
            names = ("comm_out", "comm_back") if r["phase"] in ("comm", "exposed_comm") else (r["phase"],)
            per_step = []
            for step in sorted({s["step"] for s in spans}):
                mine = merge((s["start"], s["end"]) for s in spans
                             if s["step"] == step and s["batch"] == r["batch"] and s["name"] in names)
                per_step.append(total(mine))
            if r["phase"] != "exposed_comm":
                assert r["measured_s"] == pytest.approx(statistics.median(per_step)), r
                assert r["measured_s"] > 0, r
            else:
                assert 0 <= r["measured_s"] <= statistics.median(per_step) + 1e-12, r
        assert res["step_measured_s"] > 0 and res["step_predicted_s"] > 0
