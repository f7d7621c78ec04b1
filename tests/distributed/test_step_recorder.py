"""A StepRecorder on 2 gloo ranks keeps several steps of FSDP2 and DDP runs; every rank's spans of
every kept step reach rank 0, feed the exposed-communication table and export to one Chrome trace."""

import json

import pytest

from muonlab.launcher import launch
from muonlab.trace import exposed_comm_table, phase_table, write_chrome_trace

from . import _workers_steps as W

WORLD, STEPS, KEEP = 2, 5, 4
PATHS = {"fsdp": "all_to_all", "ddp": "owner"}


@pytest.fixture(scope="module")
def results():
    return launch(W.record_steps, WORLD, list(PATHS), STEPS, KEEP, timeout_s=300)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", list(PATHS))
def test_every_rank_and_kept_step_reaches_rank_0(results, mode):
    kept = list(range(STEPS - KEEP, STEPS))  # the ring dropped the first step
    for rank in range(WORLD):
        assert results[rank][mode]["steps"] == kept and results[rank][mode]["completed"] == STEPS
        assert results[rank][mode]["clock"] == "host"
    assert results[1][mode]["rows"] is None  # gathered on rank 0 only
    rows = results[0][mode]["rows"]
    assert {(r["rank"], r["step"]) for r in rows} == {(q, s) for q in range(WORLD) for s in kept}
    # the last kept step of rank 0 is what the optimizer itself reports for its last step
    last = [dict(r, step=-1) for r in rows if r["rank"] == 0 and r["step"] == STEPS - 1]
    assert last == results[0][mode]["last"]
    for step in kept:  # every step ran the plan's batches, each with its way out and back
        mine = [r for r in rows if r["step"] == step and r["rank"] == 0]
        batches = {r["batch"] for r in mine if r["name"] == "newton_schulz"} | \
            {r["batch"] for r in results[0][mode]["rows"] if r["step"] == step and r["rank"] == 1
             and r["name"] == "newton_schulz"}
        comm = [r for r in mine if r["name"] in ("comm_out", "comm_back")]
        assert {r["path"] for r in comm} == {PATHS[mode]}
        assert sorted(r["batch"] for r in comm if r["name"] == "comm_back") == sorted(batches)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", list(PATHS))
def test_exposed_communication_table_and_chrome_trace_of_the_run(results, mode, tmp_path):
    rows = results[0][mode]["rows"]
    table = exposed_comm_table(rows)
    assert [(r["rank"], r["path"], r["steps"]) for r in table] == [(q, PATHS[mode], KEEP) for q in range(WORLD)]
    for r in table:
        assert 0 <= r["exposed_min_ms"] <= r["exposed_ms"] <= r["exposed_max_ms"]
        assert r["exposed_ms"] <= r["comm_ms"] + 1e-9 and 0 <= r["overlap_share"] <= 1
    phases = {(r["rank"], r["phase"]): r for r in phase_table(rows)}
    assert all(phases[(q, p)]["steps"] == KEEP for q in range(WORLD)
               for p in ("adamw", "momentum", "newton_schulz", "update", "comm_back", "step"))
    path = tmp_path / "trace.json"
    write_chrome_trace(rows, path)
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
    assert len(events) == len(rows) + WORLD * KEEP  # every span, and each rank's step
    assert {(e["pid"], e["args"]["step"]) for e in events} == {(q, s) for q in range(WORLD)
                                                              for s in range(STEPS - KEEP, STEPS)}
    # Perfetto's rule over the steps too: within a thread, events nest or follow one another
    by_thread = {}
    for e in events:
        by_thread.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    for thread, spans in by_thread.items():
        spans.sort()
        for a, b in zip(spans, spans[1:]):
            assert b[0] >= a[1] - 1e-3 or b[1] <= a[1] + 1e-3, (mode, thread, a, b)
