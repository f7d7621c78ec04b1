"""The step views (timeline, bytes per path, plan) on synthetic spans, and the Chrome-trace export."""

import json
from dataclasses import asdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from muonlab.trace import Span, to_chrome_trace, write_chrome_trace  # noqa: E402
from muonlab.viz.timeline import plot_bytes_by_path, plot_plan, plot_timeline  # noqa: E402

T0 = 1_700_000_000.0  # wall-clock seconds, as the tracer records them


def synthetic_spans(num_ranks=3):
    spans = []
    for r in range(num_ranks):
        t = T0 + 0.001 * r
        spans.append(Span("adamw", t, t + 0.001, rank=r))
        spans.append(Span("momentum", t + 0.001, t + 0.002, rank=r))
        # two batches in flight at once: overlapping comm spans on one rank
        spans.append(Span("comm_out", t + 0.002, t + 0.006, rank=r, path="all_to_all", batch=0,
                          bytes_sent=1024, bytes_recv=1024))
        spans.append(Span("comm_out", t + 0.003, t + 0.009, rank=r, path="agrs", batch=1,
                          bytes_sent=0 if r else 512, bytes_recv=0))
        spans.append(Span("newton_schulz", t + 0.006, t + 0.010, rank=r, path="all_to_all", batch=0))
        spans.append(Span("comm_back", t + 0.010, t + 0.014, rank=r, path="all_to_all", batch=0,
                          bytes_sent=1024, bytes_recv=1024))
        spans.append(Span("update", t + 0.014, t + 0.015, rank=r))
    return spans


def plan_rows(num_ranks=3):
    return [
        dict(batch=0, path="all_to_all", shape=(8, 4), matrices=3, names="a, b, c", ranks=num_ranks,
             max_bytes_sent=1024, total_bytes=3072, max_flops=900, notes="",
             bytes_sent=[1024] * num_ranks, bytes_recv=[1024] * num_ranks, flops=[900] * num_ranks),
        dict(batch=1, path="agrs", shape=(8, 4), matrices=1, names="d", ranks=num_ranks,
             max_bytes_sent=512, total_bytes=640, max_flops=900, notes="remainder",
             bytes_sent=[512] + [64] * (num_ranks - 1), bytes_recv=[128] * num_ranks,
             flops=[900] + [0] * (num_ranks - 1)),
    ]


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


@pytest.mark.parametrize("as_dicts", [False, True])
def test_plot_timeline_one_band_per_rank(as_dicts):
    spans = synthetic_spans()
    ax = plot_timeline([asdict(s) for s in spans] if as_dicts else spans)
    assert [t.get_text() for t in ax.get_yticklabels()] == ["rank 0", "rank 1", "rank 2"]
    assert ax.get_xlim()[0] == 0 and 14 < ax.get_xlim()[1] < 20  # ms from the first start
    labels = {t.get_text() for t in ax.get_legend().get_texts()}
    assert {"newton_schulz", "comm: all_to_all", "comm: agrs", "back (hatched)"} <= labels
    assert len(ax.collections) == len(spans)  # one bar per span


def test_plot_timeline_empty_and_given_axis():
    fig, ax = plt.subplots()
    assert plot_timeline([], ax=ax) is ax


def test_plot_bytes_by_path_dict_or_list():
    stats = {r: dict(bytes_sent={"all_to_all": 2048, "agrs": 512 * (r == 0)}, bytes_recv={}) for r in range(3)}
    ax = plot_bytes_by_path(stats)
    assert len(ax.patches) == 2 * 3  # a bar per (path, rank)
    heights = sorted(p.get_height() for p in ax.patches)
    assert heights[-1] == 2.0  # KiB
    plot_bytes_by_path(list(stats.values()), which="bytes_recv")
    with pytest.raises(ValueError):
        plot_bytes_by_path(stats, which="flops")


def test_plot_plan_per_rank_and_plain_rows():
    ax_bytes, ax_flops = plot_plan(plan_rows())
    assert len(ax_bytes.patches) == 2 * 3  # a segment per (batch, rank)
    plain = [{k: v for k, v in r.items() if k not in ("bytes_sent", "bytes_recv", "flops")} for r in plan_rows()]
    ax_bytes, ax_flops = plot_plan(plain)
    assert len(ax_bytes.patches) == 2  # a bar per batch


def test_chrome_trace_one_pid_per_rank(tmp_path):
    spans = synthetic_spans()
    path = tmp_path / "trace.json"
    write_chrome_trace(spans, path)
    trace = json.loads(path.read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    xs = [e for e in events if e["ph"] == "X"]
    assert len(xs) == len(spans)
    assert {e["pid"] for e in xs} == {0, 1, 2}
    assert min(e["ts"] for e in xs) == 0 and all(e["dur"] >= 0 for e in xs)
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1", 2: "rank 2"}
    assert to_chrome_trace(spans) == trace
