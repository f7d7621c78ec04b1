"""The plan's predicted phases (cost.predict_phases), plan_vs_run on one process, and calibrate's
profile files. Structure and agreement with the spans only: no timed assertion."""

from __future__ import annotations

import dataclasses
import json
import statistics

import pytest
import torch

from muonlab import Muon
from muonlab.calibration import calibrate, load_profile, save_profile
from muonlab.comm.cost import (MOMENTUM_PASSES, PHASES, PROFILES, UPDATE_PASSES, HardwareProfile, comm_seconds,
                               matmul_rate, predict_phases, rule_seconds, step_seconds)
from muonlab.simulate import simulate
from muonlab.comm.plan_vs_run import MEASURED_PHASES, plan_vs_run
from muonlab.trace import StepRecorder

SHAPES = [("a", (32, 16)), ("b", (32, 16)), ("c", (16, 48)), ("d", (24, 24))]

HOSTED = dataclasses.replace(
    PROFILES["cpu_gloo"], name="hosted", mem_bw=5e9, host_s_per_call=3e-5,
    matmul_rates=(("float32", "small", 2e9),),
    host_s=(("momentum", 1e-4, 2e-5), ("newton_schulz", 3e-4, 1e-5), ("update", 5e-5, 1e-5), ("between", 7e-5, 0.0)))


def _stepped(steps: int = 3):
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for _, s in SHAPES]
    opt = Muon(params, lr=1e-3)
    rec = StepRecorder(opt, keep=steps)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return opt, rec


def test_predicted_phases_follow_the_model_term_by_term():
    """Each row's phases are the profile's terms: host cost plus elements or FLOPs over the rates;
    communication is comm_seconds' (plus host per call) and the step the pipeline's end."""
    plan = simulate(SHAPES, 4)  # all_to_all over 4 ranks: every phase but the rule's
    rows = predict_phases(plan, HOSTED, rank=1, ns_choices={b.index: dict(dtype="float32", form="plain") for b in plan})
    assert [r["batch"] for r in rows] == [b.index for b in plan]
    for b, r in zip(plan, rows):
        assert set(r) == {"batch", "path", *PHASES, "transfer", "exposed_comm", "step"}
        local = b.group.local_ranks()[1]
        assert r["transfer"] == comm_seconds(b, HOSTED) > 0
        assert r["rule"] == rule_seconds(b, HOSTED) == 0.0
        # in flight at least the transfer (issue to the end of the wait); exposed no more than in flight
        assert r["transfer"] <= r["comm"] and 0.0 <= r["exposed_comm"] <= r["comm"] <= r["step"]
        if b.flops[local]:
            owned = round(b.flops[local] / (sum(b.flops) / b.num_matrices))
            assert r["newton_schulz"] == pytest.approx(
                3e-4 + 1e-5 * owned + b.flops[local] / matmul_rate(HOSTED, "float32", b.matrix_shape, "plain"))
        held = b.rows[local] * sum(s[1] for s in b.param_shapes)
        mats = -(-held // (b.matrix_shape[0] * b.matrix_shape[1]))
        assert r["momentum"] == pytest.approx(1e-4 + 2e-5 * mats + MOMENTUM_PASSES * 4 * held / 5e9)
        assert r["update"] == pytest.approx(5e-5 + 1e-5 * mats + UPDATE_PASSES * 4 * held / 5e9)
    assert len({r["step"] for r in rows}) == 1
    # more compute can only lengthen the step than step_seconds' Newton-Schulz alone
    assert rows[0]["step"] >= step_seconds(plan, HOSTED)
    with pytest.raises(ValueError, match="rank=4"):
        predict_phases(plan, HOSTED, rank=4)


def test_timeline_of_one_batch_adds_its_phases_and_both_ways():
    """One all_to_all batch on 2 ranks, no host cost: momentum, the way out (half the transfer),
    Newton-Schulz (on the matrix's owner), the way back, update. Each way lands once the later
    rank has issued it, so a rank's time in flight is the transfer plus its waits for the other."""
    profile = dataclasses.replace(PROFILES["cpu_gloo"], mem_bw=1e9)
    plan = simulate([("w", (64, 32))], 2)
    assert [b.path for b in plan] == ["all_to_all"]
    rows = [predict_phases(plan, profile, rank=rank)[0] for rank in (0, 1)]
    assert sorted(r["newton_schulz"] > 0 for r in rows) == [False, True]  # one owner
    m, n = max(r["momentum"] for r in rows), max(r["newton_schulz"] for r in rows)
    for r in rows:
        assert r["momentum"] > 0 and r["update"] > 0
        waits = r["transfer"] + (m - r["momentum"]) + (n - r["newton_schulz"])
        assert r["comm"] == pytest.approx(waits) and r["exposed_comm"] == pytest.approx(waits)
        assert r["step"] == pytest.approx(m + r["transfer"] + n + max(x["update"] for x in rows))


def test_plan_vs_run_on_one_process_reads_every_phase_from_the_spans():
    opt, rec = _stepped()
    res = plan_vs_run(opt, rec, profile=HOSTED)
    spans = rec.spans()
    assert res.steps == 3 and res.rank == 0 and res.profile == "hosted"
    plan = opt.plan()
    assert {r["batch"] for r in res.rows} == {b.index for b in plan}
    for r in res.rows:
        assert r["phase"] in MEASURED_PHASES  # local path: no communication rows
        assert r["measured_s"] > 0
        mine = [s for s in spans if s.batch == r["batch"] and s.name == r["phase"]]
        assert len(mine) == 3  # one span a step
        assert r["measured_s"] == pytest.approx(statistics.median(s.duration for s in mine))
        assert r["error"] == pytest.approx((r["predicted_s"] - r["measured_s"]) / r["measured_s"])
    step = statistics.median(max(s.end for s in spans if s.step == k and s.batch >= 0)
                             - min(s.start for s in spans if s.step == k and s.batch >= 0) for k in rec.steps)
    assert res.step_measured_s == pytest.approx(step)
    ran = {c["batch"]: c for c in opt.resolved_choices()}  # the dtype and form each batch ran in, for its rate
    assert res.step_predicted_s == predict_phases(plan, HOSTED, ns_choices=ran)[0]["step"]
    assert res.median_abs_error == pytest.approx(statistics.median(abs(r["error"]) for r in res.rows))
    assert set(res.median_abs_error_by_phase()) == {"momentum", "newton_schulz", "update"}
    assert "step" in res.table()
    # the optimizer's own last step, and a chosen step, read the same way
    assert plan_vs_run(opt, profile=HOSTED).steps == 1
    assert plan_vs_run(opt, rec, profile=HOSTED, steps=[rec.steps[-1]]).steps == 1


def test_plan_vs_run_refuses_what_it_cannot_compare():
    opt, rec = _stepped(1)
    with pytest.raises(TypeError, match="muonlab's Muon"):
        plan_vs_run(torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=1.0), rec)
    with pytest.raises(TypeError, match="recorder"):
        plan_vs_run(opt, object())
    with pytest.raises(ValueError, match="rank=3 has no spans"):
        plan_vs_run(opt, rec, rank=3)
    fresh = Muon([torch.nn.Parameter(torch.ones(4, 4))], lr=1e-3)
    with pytest.raises(ValueError, match="no spans of a Muon batch"):
        plan_vs_run(fresh)


def test_calibrated_profile_round_trips_through_json(tmp_path):
    profile = calibrate(steps=1)
    assert profile.source.startswith("muonlab.calibrate") and profile.date
    assert {p for p, *_ in profile.host_s} == {"momentum", "newton_schulz", "update", "between"}
    # the rate of the dtype Newton-Schulz runs in there, at a size where flops, not host, decide
    # (calibrate() times the default device: on a GPU, bf16); the large class, since calibrate drops
    # a class whose host cost is most of its time, and with steps=1 on a loaded machine the medium
    # class (4 x 256 x 256) was once dropped
    ran = ("bfloat16" if torch.cuda.is_available() else "float32", "large")
    assert ran in {(d, c) for d, c, _ in profile.matmul_rates}
    assert all(r > 0 for *_, r in profile.matmul_rates) and profile.mem_bw > 0
    path = tmp_path / "here.json"
    save_profile(profile, path)
    assert load_profile(path) == profile
    assert load_profile(path).host_s == profile.host_s  # tuples again, not JSON's lists


@pytest.mark.parametrize("text, match", [
    ("{not json", "is not JSON"),
    ("[1, 2]", "holds a list"),
    (json.dumps(dict(name="x")), r"fields \['inter_bw'"),
    (json.dumps(dict(dataclasses.asdict(PROFILES["cpu_gloo"]), colour="red")), r"\['colour'\] unknown"),
    (json.dumps(dict(dataclasses.asdict(PROFILES["cpu_gloo"]), mem_bw=-1.0)), "mem_bw must be a finite number > 0"),
    (json.dumps(dict(dataclasses.asdict(PROFILES["cpu_gloo"]), host_s=[["adamw", 1e-5, 0.0]])), r"phases \['adamw'\]"),
])
def test_a_bad_profile_file_is_named(tmp_path, text, match):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=match) as info:
        load_profile(path)
    assert "bad.json" in str(info.value)


def test_calibrate_refuses_bad_arguments():
    with pytest.raises(ValueError, match="torch.distributed is not initialized"):
        calibrate(process_group=object())
    with pytest.raises(ValueError, match="steps"):
        calibrate(steps=0)
    with pytest.raises(TypeError, match="HardwareProfile"):
        save_profile({"name": "x"}, "/tmp/never-written.json")
    assert isinstance(PROFILES["cpu_gloo"], HardwareProfile)
