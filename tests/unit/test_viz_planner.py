"""The planner views: distributions at large worlds, the panel's plan cache and its errors, and
sweep lines that coincide."""

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
from matplotlib.collections import LineCollection, PolyCollection  # noqa: E402

import muonlab.viz.planner as planner  # noqa: E402
from muonlab.simulate import simulate  # noqa: E402
from muonlab.viz.planner import PlannerPanel, moe_shapes, plot_plan_per_rank, plot_strategy_sweep  # noqa: E402
from muonlab.viz.timeline import DISTRIBUTION_ABOVE, plot_plan  # noqa: E402


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def _marks_per_rank(ax) -> int:
    """Artists that grow with the number of ranks: bars, and segments of line collections."""
    segments = sum(len(c.get_segments()) for c in ax.collections if isinstance(c, LineCollection))
    return len(ax.patches) + segments


def small_moe(layers=1, experts=8):
    return moe_shapes(layers=layers, experts=experts, d=64, hidden=32)


@pytest.mark.parametrize("world", [16, DISTRIBUTION_ABOVE, 2048])
def test_plan_per_rank_bars_up_to_the_threshold_then_a_distribution(world):
    plan = simulate(small_moe(experts=16), world)
    ax_bytes, ax_flops = plot_plan_per_rank(plan, world)
    for ax in (ax_bytes, ax_flops):
        if world <= DISTRIBUTION_ABOVE:
            assert len(ax.patches) >= world  # a bar (segment) per rank
        else:
            assert _marks_per_rank(ax) < 50  # not a bar or line per rank
            assert any(isinstance(c, PolyCollection) for c in ax.collections)  # the filled profile
            marks = " ".join(t.get_text() for t in ax.texts)
            assert "max" in marks and "median" in marks and "min" in marks


def test_plot_plan_rows_switch_to_a_distribution_above_the_threshold():
    world = 256
    rows = [dict(batch=0, path="all_to_all", bytes_sent=[1024] * world, flops=[10 ** 6] * world),
            dict(batch=1, path="agrs", bytes_sent=[512 * (q % 3) for q in range(world)],
                 flops=[10 ** 6 * (q == 0) for q in range(world)])]
    ax_bytes, ax_flops = plot_plan(rows)
    for ax in (ax_bytes, ax_flops):
        assert _marks_per_rank(ax) < 50
        assert "max" in " ".join(t.get_text() for t in ax.texts)
    small = plot_plan([dict(r, bytes_sent=r["bytes_sent"][:4], flops=r["flops"][:4]) for r in rows])
    assert len(small[0].patches) == 2 * 4  # a segment per (batch, rank)


def _counting_simulate(monkeypatch):
    calls = []

    def counted(*args, **kwargs):
        calls.append((args[1], kwargs.get("strategy")))
        return simulate(*args, **kwargs)

    monkeypatch.setattr(planner, "simulate", counted)
    return calls


def test_views_seen_before_are_drawn_without_simulating_again(monkeypatch):
    calls = _counting_simulate(monkeypatch)

    def shapes(layers=1, experts=8):  # a function of its own: nothing of it is cached yet
        return small_moe(layers, experts)

    kw = dict(ep=2, experts=8, layers=1, sweep_worlds=(4, 8, 16))
    first = planner.simulate_views(shapes, world=8, **kw)
    num_simulated = len(calls)
    assert num_simulated == 3 * 3  # every strategy at every sweep world, the plotted one among them
    again = planner.simulate_views(shapes, world=8, **kw)
    other_world = planner.simulate_views(shapes, world=16, strategy="xtuner", **kw)
    assert len(calls) == num_simulated  # in the sweep already: nothing simulated again
    assert again["plan"] == first["plan"] and again["summary"] == first["summary"]
    assert again["sweep"] == first["sweep"] == other_world["sweep"]
    assert other_world["plan"] == simulate(shapes(1, 8), (8, 2), strategy="xtuner")
    planner.simulate_views(shapes, world=32, **kw)  # a world outside the sweep: its strategies only
    assert len(calls) == num_simulated + 3
    planner._plan.cache_clear()  # plans are let go before summaries (they weigh megabytes at 2048 ranks)
    planner.simulate_views(shapes, world=16, **kw)
    assert calls[num_simulated + 3:] == [((8, 2), "muonlab")]  # only the plan drawn per rank
    planner.clear_plan_cache()
    planner.simulate_views(shapes, world=8, **kw)
    assert len(calls) == 2 * num_simulated + 4


def test_panel_error_clears_the_old_figure_and_table():
    pytest.importorskip("ipywidgets", reason="notebook bars and panels are ipywidgets (the lab extra)")
    panel = PlannerPanel(small_moe, world=16, ep=2, experts=8, layers=1, worlds=(8, 16), auto=False)
    assert panel.update() is not None
    assert len(panel.output.outputs) == 1 and "image/png" in panel.output.outputs[0]["data"]
    assert "<table" in panel.table.value and panel.last is not None
    panel.ep.value = 16
    panel.world.value = 8  # 16 does not divide 8
    assert panel.update() is None
    assert panel.output.outputs == () and panel.table.value == "" and panel.last is None
    assert "ValueError" in panel.status.value and "ep=16" in panel.status.value
    assert plt.get_fignums() == []  # nothing left to appear under the cell


def test_panel_shows_any_error_of_the_callback(monkeypatch):
    pytest.importorskip("ipywidgets", reason="notebook bars and panels are ipywidgets (the lab extra)")
    panel = PlannerPanel(small_moe, world=8, ep=1, experts=8, layers=1, worlds=(8,), auto=False)
    panel.update()

    def broken(**_kwargs):
        raise RuntimeError("planner <broke>")

    monkeypatch.setattr(panel, "callback", broken)
    assert panel.update() is None
    assert panel.output.outputs == () and panel.table.value == ""
    assert "RuntimeError: planner &lt;broke&gt;" in panel.status.value  # escaped, not HTML


def _rows(values_by_strategy):
    return [dict(model="m", W=W, strategy=s, bytes_over_bound=b, modelled_s=t)
            for s, points in values_by_strategy.items() for W, b, t in points]


def test_coinciding_sweep_lines_stay_apart_and_are_named():
    same = [(8, 1.0, 1e-3), (64, 2.0, 2e-3)]
    rows = _rows({"muonlab": [(8, 0.5, 5e-4), (64, 0.5, 5e-4)], "padded_all_to_all": same,
                  "xtuner": same[:1] + [(64, 3.0, 3e-3)]})
    ax_ratio, ax_time = plot_strategy_sweep(rows)
    for ax in (ax_ratio, ax_time):
        lines = {line.get_color(): line for line in ax.get_lines() if len(line.get_xdata()) == 2}
        padded, xtuner = lines["#ff7f0e"], lines["#2ca02c"]
        assert list(padded.get_xdata()) != list(xtuner.get_xdata())  # set apart along x
        assert padded.get_marker() != xtuner.get_marker()
        assert padded.get_markersize() != xtuner.get_markersize()
        assert padded.get_linewidth() != xtuner.get_linewidth()
    labels = [t.get_text() for t in ax_time.get_legend().get_texts()]
    assert labels == ["muonlab", "padded_all_to_all", "xtuner (= padded_all_to_all at 1 of 2 points)"]
    rows = _rows({"padded_all_to_all": same, "xtuner": same})
    labels = [t.get_text() for t in plot_strategy_sweep(rows)[1].get_legend().get_texts()]
    assert labels == ["padded_all_to_all", "xtuner (= padded_all_to_all everywhere)"]
