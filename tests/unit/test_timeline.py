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


def _bar_totals(ax, num_ranks):
    """The height of each rank's stack of bars (a bar is centred on its rank's x)."""
    totals = [0.0] * num_ranks
    for patch in ax.patches:
        totals[round(patch.get_x() + patch.get_width() / 2)] += patch.get_height()
    return totals


def test_plot_plan_draws_batch_plans_per_global_rank_on_an_expert_mesh(monkeypatch):
    from muonlab.comm.records import per_rank
    from muonlab.simulate import simulate

    # (fsdp=2, ep=2): the expert bank's batch is planned over the 2 ranks of an "fsdp" axis, each
    # standing for 2 global ranks; the dense batches over all 4
    plan = simulate([("attn", (64, 64)), ("mlp", (128, 64)), ("experts", (4, 64, 32))], (2, 2))
    assert {len(b.flops) for b in plan} == {2, 4}
    truth = per_rank(plan, 4)
    ax_bytes, ax_flops = plot_plan(list(plan))
    assert [t.get_text() for t in ax_flops.get_xticklabels()] == [f"rank {q}" for q in range(4)]
    assert _bar_totals(ax_flops, 4) == pytest.approx([f * 1e-6 for f in truth["flops"]])
    assert _bar_totals(ax_bytes, 4) == pytest.approx([b / 1024 for b in truth["sent"]])

    # above DISTRIBUTION_ABOVE ranks: the distribution of the same global totals, by path
    import muonlab.viz.timeline as timeline

    drawn = {}

    def spy(ax, stacks, units, *, what=None):
        drawn[what] = {path: list(v) for path, v in stacks.items()}
        return real(ax, stacks, units, what=what)

    real = timeline.plot_rank_distribution
    monkeypatch.setattr(timeline, "plot_rank_distribution", spy)
    big = simulate([("attn", (64, 64)), ("experts", (8, 64, 32))], (64, 2))
    world = 128
    assert {len(b.flops) for b in big} == {64, world}  # the experts' batch on a 64-rank "fsdp" axis
    plot_plan(big)
    truth = per_rank(big, world, by_path=True)
    assert drawn["FLOPs"] == {path: t["flops"] for path, t in truth.items()}
    assert drawn["bytes sent"] == {path: t["sent"] for path, t in truth.items()}


def test_plot_plan_refuses_plain_rows_of_groups_of_different_sizes():
    from muonlab.experiments.train import plan_rows as rows_of
    from muonlab.simulate import simulate

    plan = simulate([("attn", (64, 64)), ("experts", (4, 64, 32))], (2, 2))
    with pytest.raises(ValueError, match=r"different lengths \(row 0 \(batch 0\) has 4, row 1 \(batch 1\) has 2\)"):
        plot_plan(rows_of(plan))
    plot_plan(rows_of(simulate([("attn", (64, 64)), ("mlp", (128, 64))], 4)))  # one group: drawn as they are
    # an empty list adds nothing at any rank: not a length of its own
    plot_plan(plan_rows() + [dict(plan_rows()[0], batch=2, bytes_sent=[], bytes_recv=[], flops=[])])
