"""Where step time goes: interval arithmetic, exposed/overlapped communication on hand-made spans
with known answers, the StepRecorder on a real Muon, the Chrome export and figures of many steps."""

import json
import math

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from muonlab import Muon, muon_param_groups  # noqa: E402
from muonlab.comm.paths import PATHS  # noqa: E402
from muonlab.trace import (Span, StepRecorder, exposed_comm_table, format_table, phase_table,  # noqa: E402
                           to_chrome_trace, write_chrome_trace)
from muonlab.trace.step_time import intersection, merge, per_step, total  # noqa: E402
from muonlab.viz.timeline import ns_choice_label, plot_step_time, plot_timeline  # noqa: E402

T0 = 1_000.0  # seconds; small, so that ms differences are exact to 1e-9


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def test_merge_joins_overlapping_and_touching_intervals_and_drops_empty_ones():
    assert merge([(5, 8), (1, 4), (3, 5), (9, 9), (10, 12), (11, 11.5)]) == [(1, 8), (10, 12)]
    assert merge([]) == [] and total(merge([(0, 2), (1, 3), (4, 5)])) == 4


def test_intersection_of_interval_lists():
    a = merge([(0, 2), (4, 8), (10, 11)])
    b = merge([(1, 5), (7, 12)])
    # (1, 2) + (4, 5) + (7, 8) + (10, 11)
    assert intersection(a, b) == 4 and intersection(b, a) == 4
    assert intersection(a, []) == 0 and intersection(a, merge([(2, 4)])) == 0  # touching: no overlap
    # one long interval against many short ones, in both orders
    assert intersection([(0, 100)], a) == total(a) == intersection(a, [(0, 100)])


def hand_made_steps(rank: int = 0) -> list[Span]:
    """Three steps of one rank, times in ms after T0 (+100 ms per step). Per step: compute adamw
    [0, 1], newton_schulz [3, 5], update [8, 9] (step 1: [10, 11]); comm on path "a": out [1, 4]
    (1 ms under newton_schulz), back [5, 8] (step 1: [5, 10]; step 2: [5, 7]), none of it under
    compute; path "b": out [2, 6], 2 ms under newton_schulz."""
    spans = []
    for step, (back_end, update) in enumerate([(8, (8, 9)), (10, (10, 11)), (7, (8, 9))]):
        def at(ms, base=100 * step):
            return T0 + (base + ms) * 1e-3
        spans += [
            Span("adamw", at(0), at(1), rank=rank, step=step),
            Span("comm_out", at(1), at(4), rank=rank, path="a", batch=0, bytes_sent=8, step=step),
            Span("comm_out", at(2), at(6), rank=rank, path="b", batch=1, bytes_sent=8, step=step),
            Span("newton_schulz", at(3), at(5), rank=rank, path="a", batch=0, step=step),
            Span("comm_back", at(5), at(back_end), rank=rank, path="a", batch=0, bytes_recv=8, step=step),
            Span("update", at(update[0]), at(update[1]), rank=rank, batch=0, step=step),
        ]
    return spans


def test_per_step_exposed_communication_has_the_known_answers():
    steps = per_step(hand_made_steps())
    assert [(s["step"], s["rank"]) for s in steps] == [(0, 0), (1, 0), (2, 0)]
    ms = [{k: {p: v * 1e3 for p, v in s[k].items()} for k in ("comm", "exposed")} for s in steps]
    # path a: out [1, 4] + back [5, back_end]; 1 ms of it under newton_schulz [3, 5]
    assert [m["comm"]["a"] for m in ms] == pytest.approx([6, 8, 5])
    assert [m["exposed"]["a"] for m in ms] == pytest.approx([5, 7, 4])
    # path b: [2, 6], of which [3, 5] under compute
    assert [m["comm"]["b"] for m in ms] == pytest.approx([4, 4, 4])
    assert [m["exposed"]["b"] for m in ms] == pytest.approx([2, 2, 2])
    # all: the union [1, back_end] minus newton_schulz's 2 ms; less than a's + b's exposed
    assert [m["comm"]["all"] for m in ms] == pytest.approx([7, 9, 6])
    assert [m["exposed"]["all"] for m in ms] == pytest.approx([5, 7, 4])
    assert [s["spanned"] * 1e3 for s in steps] == pytest.approx([9, 11, 9])
    assert steps[0]["phases"]["comm_out"] * 1e3 == pytest.approx(5)  # [1, 4] and [2, 6] counted once


def test_exposed_comm_table_medians_spread_and_overlap_share():
    spans = hand_made_steps(0) + hand_made_steps(1)
    rows = exposed_comm_table(spans)
    assert [(r["rank"], r["path"]) for r in rows] == [(0, "a"), (0, "b"), (0, "all"), (1, "a"), (1, "b"), (1, "all")]
    a = rows[0]
    assert a["steps"] == 3
    assert (a["exposed_ms"], a["exposed_min_ms"], a["exposed_max_ms"]) == pytest.approx((5, 4, 7))
    assert a["comm_ms"] == pytest.approx(6)
    assert a["overlap_share"] == pytest.approx(3 / 19)  # 1 ms hidden per step of 6 + 8 + 5
    assert a["exposed_share"] == pytest.approx(statistics_median([5 / 9, 7 / 11, 4 / 9]))
    assert rows[1]["overlap_share"] == pytest.approx(0.5)
    every = rows[2]
    assert every["overlap_share"] == pytest.approx(6 / 22)
    # one path only: no "all" row repeating it
    only_a = [s for s in hand_made_steps() if s.path != "b"]
    assert [r["path"] for r in exposed_comm_table(only_a)] == ["a"]
    text = format_table(rows)
    assert "16%" in text and text.splitlines()[0].split()[:2] == ["rank", "path"]


def statistics_median(values):
    values = sorted(values)
    return values[len(values) // 2]


def test_tables_over_the_steps_asked_for():
    spans = hand_made_steps()
    # steps 1 and 2 only: path a exposed 7 and 4 ms
    a = exposed_comm_table(spans, steps=[1, 2])[0]
    assert a["steps"] == 2 and (a["exposed_min_ms"], a["exposed_max_ms"]) == pytest.approx((4, 7))
    assert exposed_comm_table(spans, steps=range(1, 3)) == exposed_comm_table(spans, steps=2)
    assert phase_table(spans, steps=1)[0]["steps"] == 1
    with pytest.raises(ValueError, match=r"steps \[5\] have no spans"):
        phase_table(spans, steps=[5])
    with pytest.raises(ValueError, match="steps must be None, an int"):
        per_step(spans, steps=2.5)


def test_phase_table_per_rank_in_step_order_with_exposed_and_step_last():
    rows = phase_table(hand_made_steps())
    assert [r["phase"] for r in rows] == ["adamw", "comm_out", "newton_schulz", "comm_back", "update",
                                          "exposed comm", "step"]
    back = rows[3]
    assert (back["median_ms"], back["min_ms"], back["max_ms"]) == pytest.approx((3, 2, 5))
    assert rows[-1]["median_ms"] == pytest.approx(9) and rows[-1]["share"] == 1.0
    assert rows[-2]["max_ms"] == pytest.approx(7)


def test_chrome_trace_of_many_steps_is_valid_json_with_every_steps_events(tmp_path):
    spans = hand_made_steps(0) + hand_made_steps(1)
    path = tmp_path / "trace.json"
    write_chrome_trace(spans, path)
    trace = json.loads(path.read_text())
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    for rank in (0, 1):
        for step in range(3):
            mine = [e for e in events if e["pid"] == rank and e["args"]["step"] == step]
            assert len(mine) == 6 + 1, (rank, step)  # the six spans and the step's own event
            marker = [e for e in mine if e["tid"] == 0]
            assert [e["name"] for e in marker] == [f"step {step}"]
            assert marker[0]["dur"] == pytest.approx((11 if step == 1 else 9) * 1e3)
    # each thread's events nest (Perfetto's rule), over all the steps
    by_thread = {}
    for e in events:
        by_thread.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    for intervals in by_thread.values():
        intervals.sort()
        assert all(b[0] >= a[1] - 1e-6 or b[1] <= a[1] + 1e-6 for a, b in zip(intervals, intervals[1:]))
    names = {(e["pid"], e["args"]["name"]) for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert (0, "optimizer step") in names and (1, "optimizer step") in names


def test_chrome_trace_of_one_unnumbered_step_has_no_step_events():
    spans = [Span("adamw", T0, T0 + 0.001), Span("update", T0 + 0.001, T0 + 0.002)]
    events = to_chrome_trace(spans)["traceEvents"]
    assert sum(e["ph"] == "X" for e in events) == 2 and not any(e.get("tid") == 0 for e in events)


def test_a_span_with_a_step_that_is_no_integer_is_named():
    with pytest.raises(ValueError, match=r"span 1 \('update' on rank 0\) has step '2'"):
        per_step([Span("adamw", T0, T0 + 1), Span("update", T0, T0 + 1, step="2")])


# ------------------------------------------------------------------------- the recorder


def _muon_and_model(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    return model, Muon(muon_param_groups(model, adamw_lr=1e-3), lr=0.02)


def _train(model, opt, steps):
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        model(torch.randn(4, 16, generator=gen)).square().mean().backward()
        opt.step()
        opt.zero_grad()


def test_recorder_keeps_the_last_steps_numbered_and_bounded():
    model, opt = _muon_and_model()
    rec = StepRecorder(opt, keep=3, first_step=10)
    _train(model, opt, 5)
    assert rec.completed == 5 and rec.steps == [12, 13, 14]
    spans = rec.spans()
    assert {s.step for s in spans} == {12, 13, 14}
    assert rec.clock == "host"
    # each kept step holds the spans the optimizer reported for it
    last = opt.last_step_spans()
    assert [(s.name, s.batch, s.start, s.end) for s in spans if s.step == 14] == \
        [(s.name, s.batch, s.start, s.end) for s in last]
    assert {"adamw", "momentum", "newton_schulz", "update"} <= {s.name for s in last}
    rows = rec.rows()
    assert rows == rec.gather() and all(isinstance(r, dict) and r["step"] in (12, 13, 14) for r in rows)
    assert [s["step"] for s in per_step(rows)] == [12, 13, 14]
    rec.detach()
    _train(model, opt, 1)
    assert rec.completed == 5 and rec.steps == [12, 13, 14]  # detached: nothing more recorded


def test_recorder_keeps_gpu_times_and_synchronises_once_per_recorded_step(monkeypatch):
    """On CUDA the kept spans are the event times (FakeCuda's clock: 1 ms per record), resolved
    in the step's post-hook: one synchronisation per recorded step, none for a step not recorded."""
    from test_trace import FakeCuda  # tests/unit's fake CUDA events

    cuda = FakeCuda(monkeypatch)
    model, opt = _muon_and_model()
    monkeypatch.setattr(opt, "_trace_device", lambda: torch.device("cuda", 0))  # the work stays on CPU
    rec = StepRecorder(opt, every=2)
    assert rec.clock == "gpu"
    _train(model, opt, 3)
    assert rec.steps == [0, 2] and cuda.syncs == 2
    compute = [s for s in rec.spans() if s.name in ("momentum", "newton_schulz", "update", "adamw")]
    assert compute and all(s.duration == pytest.approx(1e-3, abs=1e-6) for s in compute)


def test_recorder_every_k_steps():
    model, opt = _muon_and_model()
    rec = StepRecorder(opt, every=2)
    _train(model, opt, 5)
    assert rec.steps == [0, 2, 4]
    rec.clear()
    assert rec.steps == [] and rec.spans() == []


@pytest.mark.parametrize("kwargs, match", [
    (dict(keep=0), "keep must be a whole number >= 1"), (dict(every=1.5), "every must be"),
    (dict(first_step=-1), "first_step must be a whole number >= 0"), (dict(keep=math.inf), "keep"),
    (dict(every=True), "every"),
])
def test_recorder_refuses_bad_options_before_attaching(kwargs, match):
    model, opt = _muon_and_model()
    with pytest.raises(ValueError, match=match):
        StepRecorder(opt, **kwargs)
    assert not opt._optimizer_step_post_hooks  # nothing attached


def test_recorder_refuses_an_optimizer_that_records_no_spans():
    model = torch.nn.Linear(4, 4)
    with pytest.raises(TypeError, match="StepRecorder records muonlab's Muon.*got AdamW"):
        StepRecorder(torch.optim.AdamW(model.parameters()))


# ------------------------------------------------------------------------- figures


CHOICES = [dict(batch=0, form="gram", dtype="float32", backend="torch"),
           dict(batch=1, form="gram", dtype="float32", backend="torch"),
           dict(batch=2, form="plain", dtype="float32", backend="torch")]


def test_ns_choice_label_groups_batches():
    assert ns_choice_label(CHOICES) == ("Newton-Schulz: gram form, float32, torch (batches 0-1); "
                                        "plain form, float32, torch (batch 2)")
    assert ns_choice_label(CHOICES[:2]) == "Newton-Schulz: gram form, float32, torch (every batch)"


def test_timeline_of_several_steps_lays_them_end_to_end_and_labels_them():
    spans = hand_made_steps(0) + hand_made_steps(1)
    ax = plot_timeline(spans, choices=CHOICES, clock="host")
    texts = [t.get_text() for t in ax.texts]
    assert [t for t in texts if t.startswith("step")] == ["step 0", "step 1", "step 2"]
    # three steps of 9, 11 and 9 ms with two gaps of 6% of the median (9 ms): the gaps are cut
    assert ax.get_xlim()[1] == pytest.approx((29 + 2 * 0.54) * 1.01)
    title = ax.get_title()
    assert "3 optimizer steps" in title and "host wall clock" in title and "(batches 0-1)" in title
    # communication bars carry their batch numbers, as compute bars do
    assert texts.count("1") >= 3 * 2  # path b's batch 1: a comm bar per step and rank
    only_last = plot_timeline(spans, steps=1)
    assert [t.get_text() for t in only_last.texts if t.get_text().startswith("step")] == []
    assert only_last.get_xlim()[1] == pytest.approx(9 * 1.01)
    with pytest.raises(ValueError, match=r"steps \[7\] have no spans; the spans hold steps \[0, 1, 2\]"):
        plot_timeline(spans, steps=[2, 7])
    with pytest.raises(ValueError, match="steps must be >= 1"):
        plot_timeline(spans, steps=0)


def test_timeline_legend_swatches_of_direction_and_bytes_differ():
    """The way out, the way back and "no bytes" used to be drawn alike (two empty boxes under
    DDP); now: a grey fill, a hatched grey fill, a dashed outline."""
    spans = hand_made_steps()
    spans[1].bytes_sent = 0  # a way out that moved nothing on this rank
    legend = plot_timeline(spans).get_legend()
    swatch = {t.get_text().split(" (")[0]: h for t, h in zip(legend.get_texts(), legend.legend_handles)}

    def filled(h):  # a fill one sees: opaque and not white
        r, g, b, a = h.get_facecolor()
        return a > 0.5 and min(r, g, b) < 0.9

    out, back, none = swatch["out"], swatch["back"], swatch["no bytes on this rank"]
    assert filled(out) and not out.get_hatch()
    assert filled(back) and back.get_hatch()
    # the legend's copy of a patch keeps its dashes (what is drawn), not its linestyle's name
    assert not filled(none) and not none.get_hatch() and none._dash_pattern[1]


def test_timeline_legend_swatches_are_told_apart_with_every_path():
    """No two swatches alike: the local path's grey once matched the way-out swatch's."""
    spans = hand_made_steps() + [Span("momentum", T0 + 0.019, T0 + 0.0195, batch=3)]
    spans[1].bytes_sent = 0
    for k, path in enumerate(PATHS):
        spans.append(Span("comm_out", T0 + 0.02, T0 + 0.021, path=path, batch=10 + k, bytes_sent=4))
    legend = plot_timeline(spans).get_legend()
    looks = [(t.get_text(), h.get_facecolor(), h.get_hatch() or "", bool(h._dash_pattern[1]))
             for t, h in zip(legend.get_texts(), legend.legend_handles)]
    assert len(looks) == len(PATHS) + 2 + 4 + 3  # paths, "a" and "b" (black), phases, directions and bytes
    for i, (name, face, hatch, dashed) in enumerate(looks):
        for other, face2, hatch2, dashed2 in looks[i + 1:]:
            if (hatch, dashed) == (hatch2, dashed2) and not (name.startswith("comm: ") and other.startswith("comm: ")
                                                            and face == face2):
                assert max(abs(a - b) for a, b in zip(face[:3], face2[:3])) > 0.12, (name, other)


def test_plot_step_time_draws_each_rank_and_path():
    spans = hand_made_steps(0) + hand_made_steps(1)
    ax_bars, ax_steps = plot_step_time(spans, clock="gpu")
    assert [t.get_text() for t in ax_bars.get_xticklabels()] == ["rank 0", "rank 1"]
    shares = sorted(t.get_text() for t in ax_bars.texts)
    assert shares == sorted(["16%", "50%", "27%"] * 2)
    assert len(ax_steps.get_lines()) == 4  # exposed and spanned per rank
    assert "GPU time (CUDA events)" in ax_bars.figure._suptitle.get_text()
