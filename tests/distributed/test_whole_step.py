"""A 2-rank FSDP2 run's whole-step timeline (train_worker(whole_step_timeline=N), one gloo launch):
forward, backward, FSDP2's all-gathers and reduce-scatters and the optimizer's spans on both ranks,
in the order a step runs them, the exposed-communication table per kind, the Chrome trace."""

import json

import pytest

from muonlab.launcher import launch
from muonlab.experiments.train import train_worker
from muonlab.trace import exposed_comm_table, phase_table, write_chrome_trace
from muonlab.trace.spans import LANES
from muonlab.trace.step_time import merge, per_step

WORLD, STEPS, WINDOW = 2, 3, 2
TINY = dict(d_model=16, n_layers=2, n_heads=2, context=8, batch_per_rank=2, ns_dtype_name="fp32", record=False)
FSDP = {"all_gather": "fsdp_all_gather", "reduce_scatter": "fsdp_reduce_scatter"}
OPTIMIZER = ("adamw", "momentum", "comm_out", "newton_schulz", "comm_back", "update")


@pytest.fixture(scope="module")
def results():
    return launch(train_worker, WORLD, mode="fsdp", steps=STEPS, whole_step_timeline=WINDOW, timeout_s=240, **TINY)


def _of(rows, rank, step, *names):
    return sorted((r for r in rows if r["rank"] == rank and r["step"] == step and r["name"] in names),
                  key=lambda r: r["start"])


@pytest.mark.timeout(300)
def test_every_rank_has_each_phase_in_the_order_a_step_runs_them(results):
    rows = results[0]["whole_step_spans"]
    assert results[1]["whole_step_spans"] is None  # gathered on rank 0
    window = list(range(STEPS - WINDOW, STEPS))  # the last steps
    assert {(r["rank"], r["step"]) for r in rows} == {(q, s) for q in range(WORLD) for s in window}
    ends = {}
    for rank in range(WORLD):
        for step in window:
            forward, backward = _of(rows, rank, step, "forward"), _of(rows, rank, step, "backward")
            gathers, scatters = _of(rows, rank, step, "all_gather"), _of(rows, rank, step, "reduce_scatter")
            optimizer = _of(rows, rank, step, *OPTIMIZER)
            assert forward and backward and gathers and scatters, (rank, step)
            assert {r["name"] for r in optimizer} == set(OPTIMIZER), (rank, step)
            assert {r["path"] for r in gathers + scatters} == set(FSDP.values())
            for name, path in FSDP.items():
                assert all(r["path"] == path for r in _of(rows, rank, step, name))
            # forward, then backward, then the optimizer; the first all-gather opens the forward
            assert forward[-1]["end"] <= backward[0]["start"] and backward[-1]["end"] <= optimizer[0]["start"]
            assert forward[0]["start"] <= gathers[0]["start"] <= forward[0]["end"]
            assert backward[0]["start"] <= scatters[0]["start"] and scatters[-1]["end"] <= optimizer[0]["start"]
            # the rank's thread computes or waits on FSDP2, never both: pieces and FSDP2's collectives
            # (synchronous on gloo) lie apart, each on its own
            mine = sorted(forward + backward + gathers + scatters, key=lambda r: r["start"])
            assert all(a["end"] <= b["start"] for a, b in zip(mine, mine[1:])), (rank, step)
            ends[(rank, step)] = (min(r["start"] for r in mine), max(r["end"] for r in mine + optimizer))
    for rank in range(WORLD):  # steps follow each other
        assert ends[(rank, window[0])][1] <= ends[(rank, window[1])][0]


@pytest.mark.timeout(300)
def test_the_exposed_table_per_kind_adds_up(results):
    rows = results[0]["whole_step_spans"]
    table = exposed_comm_table(rows)
    kinds = ["all_to_all", *FSDP.values(), "all"]
    assert [(r["rank"], r["path"], r["steps"]) for r in table] == [(q, k, WINDOW) for q in range(WORLD) for k in kinds]
    for r in table:
        assert 0 <= r["exposed_min_ms"] <= r["exposed_ms"] <= r["exposed_max_ms"]
        assert r["exposed_ms"] <= r["comm_ms"] * (1 + 1e-9) and 0 <= r["overlap_share"] <= 1
        if r["path"] in FSDP.values():  # synchronous on gloo: the thread waited the whole time
            assert r["overlap_share"] < 0.05, r
    for s in per_step(rows):
        paths = [p for p in s["comm"] if p != "all"]
        # the union over kinds: at most their sum, at least the largest; the spanned step holds it all
        exposed = [s["exposed"][p] for p in paths]
        assert max(exposed) - 1e-12 <= s["exposed"]["all"] <= sum(exposed) + 1e-12
        assert s["comm"]["all"] <= s["spanned"] + 1e-12
        compute = merge((r["start"], r["end"]) for r in rows
                        if (r["rank"], r["step"]) == (s["rank"], s["step"]) and LANES[r["name"]] == "compute")
        busy = sum(e - a for a, e in compute)
        assert busy + s["exposed"]["all"] <= s["spanned"] * (1 + 1e-9)
    phases = {(r["rank"], r["phase"]) for r in phase_table(rows)}
    kinds = ("forward", "backward", "all_gather", "reduce_scatter", "step")
    assert {(q, p) for q in range(WORLD) for p in kinds} <= phases


@pytest.mark.timeout(300)
def test_the_chrome_trace_of_the_whole_steps_loads_with_every_kind(results, tmp_path):
    rows = results[0]["whole_step_spans"]
    path = tmp_path / "whole.json"
    write_chrome_trace(rows, path)
    trace = json.loads(path.read_text())["traceEvents"]
    spans = [e for e in trace if e["ph"] == "X" and not e["name"].startswith("step ")]
    assert len(spans) == len(rows)
    for rank in range(WORLD):
        names = {e["name"] for e in spans if e["pid"] == rank}
        assert {"forward", "backward", "all_gather[fsdp_all_gather]", "reduce_scatter[fsdp_reduce_scatter]",
                "newton_schulz[all_to_all]"} <= names
        threads = {e["args"]["name"] for e in trace if e["name"] == "thread_name" and e["pid"] == rank}
        assert {"compute", "comm fsdp_all_gather", "comm fsdp_reduce_scatter"} <= threads
    assert sum(e["name"].startswith("step ") for e in trace if e["ph"] == "X") == WORLD * WINDOW
