"""Views of the planner: per-rank bytes and FLOPs of one plan, strategies across world sizes, and
an ipywidgets panel that re-simulates as the mesh or the model changes.

Everything here reads ``muonlab.comm.records`` only: a ``Plan`` (or its ``BatchPlan`` list, as
``Muon.plan()`` and ``train_worker`` return it) and ``summarize()`` rows. Nothing is launched: the
panel's plans come from ``simulate``, the same planner a real step runs.

    from muonlab.viz.planner import planner_panel, moe_shapes
    panel = planner_panel(moe_shapes)   # display it; panel.callback(world=64, ...) runs it directly
"""

from __future__ import annotations

import functools
import html
import inspect
import math
from collections.abc import Callable, Iterable, Mapping, Sequence

import matplotlib.pyplot as plt
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from ..comm.records import per_rank
from ..simulate import SIMULATED_STRATEGIES, simulate, summarize
from .panel_output import check_choice, check_range, show_figure
from .timeline import (BYTE_UNITS, DISTRIBUTION_ABOVE, FLOP_UNITS, _ordered_paths, _path_color,
                       plot_rank_distribution, scale_for)

__all__ = ["PlannerPanel", "clear_plan_cache", "dense_shapes", "moe_shapes", "planner_panel",
           "plot_plan_per_rank", "plot_strategy_sweep", "simulate_views"]

# Marker shape, size and fill differ as well as the colour, and lines get thinner down the list,
# so a strategy drawn over another with the very same values still shows both.
STRATEGY_STYLES = {"muonlab": dict(color="#1f77b4", marker="o", ms=4, lw=2.6),
                   "padded_all_to_all": dict(color="#ff7f0e", marker="s", ms=8, mfc="none", mew=1.3, lw=1.7),
                   "xtuner": dict(color="#2ca02c", marker="^", ms=6, mfc="none", mew=1.3, lw=1.0)}
_OTHER_STYLE = dict(color="0.4", marker="x", ms=6, lw=1.0)
MODEL_LINESTYLES = ("-", "--", ":", "-.")
DEFAULT_SWEEP = (8, 16, 32, 64, 128, 256, 512, 1024, 2048)


# ---------------------------------------------------------------- model shapes (Muon matrices only)

def dense_shapes(layers: int = 60, d: int = 4096, kv: int = 1024, ffn: int = 10944) -> list[tuple[str, tuple]]:
    """A dense decoder's Muon matrices: grouped-query attention (q, k, v, o) and a SwiGLU MLP."""
    out = []
    for i in range(layers):
        out += [(f"l{i}.q", (d, d)), (f"l{i}.k", (kv, d)), (f"l{i}.v", (kv, d)), (f"l{i}.o", (d, d)),
                (f"l{i}.gate", (ffn, d)), (f"l{i}.up", (ffn, d)), (f"l{i}.down", (d, ffn))]
    return out


def moe_shapes(layers: int = 24, experts: int = 128, d: int = 2048, hidden: int = 1024) -> list[tuple[str, tuple]]:
    """An MoE decoder's Muon matrices: fused qkv, out, router and two expert banks (E, out, in)."""
    out = []
    for i in range(layers):
        out += [(f"l{i}.qkv", (3 * d, d)), (f"l{i}.o", (d, d)), (f"l{i}.router", (experts, d)),
                (f"l{i}.w_in", (experts, hidden, d)), (f"l{i}.w_out", (experts, d, hidden))]
    return out


# ---------------------------------------------------------------- one plan, per global rank

def _stacked(ax, per: dict[str, dict[str, list[int]]], key: str, world: int, units) -> list[str]:
    paths = [p for p in _ordered_paths(per) if any(per[p][key])]
    if world > DISTRIBUTION_ABOVE:
        return plot_rank_distribution(ax, {p: per[p][key] for p in paths}, units,
                                      what="bytes sent" if key == "sent" else "FLOPs")[0]
    totals = [sum(per[p][key][g] for p in paths) for g in range(world)]
    factor, unit = scale_for(max(totals, default=0), units)
    bottom = [0.0] * world
    xs = list(range(world))
    for p in paths:
        vals = [v / factor for v in per[p][key]]
        ax.bar(xs, vals, bottom=bottom, color=_path_color(p), width=0.8, edgecolor="white", lw=0.5)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xlim(-0.6, world - 0.4)
    if max(bottom, default=0) > 0:
        ax.set_ylim(0, 1.06 * max(bottom))
    if world <= 16:
        ax.set_xticks(xs)
    ax.set_xlabel("global rank")
    ax.grid(axis="y", alpha=0.3)
    ax.set_ylabel(unit)
    return paths


def plot_plan_per_rank(plan, world: int, ax=None, *, title: str = "plan"):
    """Bytes sent and Newton-Schulz FLOPs per GLOBAL rank, stacked by path.

    ``plan``: a ``Plan`` or a list of ``BatchPlan`` (``Muon.plan()``, ``simulate()``,
    ``train_worker(...)["plan_batches"]``). ``ax``: None (a new figure) or a pair of axes
    (bytes, FLOPs). Up to ``DISTRIBUTION_ABOVE`` (64) ranks are bars; more are drawn as their
    distribution (ranks sorted by load, min / median / max marked). Returns the pair.
    """
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    batches = list(plan)
    per = per_rank(batches, world, by_path=True)  # refuses a world the plan doesn't fit: before any figure
    if ax is None:
        _, ax = plt.subplots(1, 2, figsize=(11, 3.4))
    ax_bytes, ax_flops = ax
    seen = _stacked(ax_bytes, per, "sent", world, BYTE_UNITS)
    seen += [p for p in _stacked(ax_flops, per, "flops", world, FLOP_UNITS) if p not in seen]
    ax_bytes.set_ylabel(ax_bytes.get_ylabel() + " sent per step")
    ax_flops.set_ylabel(ax_flops.get_ylabel() + " Newton-Schulz per step")
    ax_bytes.set_title(f"{title}: bytes sent per rank", fontsize=11)
    ax_flops.set_title(f"{title}: NS FLOPs per rank", fontsize=11)
    paths = _ordered_paths(seen or {b.path for b in batches})
    if paths:
        ax_flops.legend(handles=[Patch(facecolor=_path_color(p), label=p) for p in paths], fontsize=8,
                        loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    return ax_bytes, ax_flops


# ---------------------------------------------------------------- strategies across world sizes

def _coincide(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-9 * max(abs(a), abs(b))


def _ties(rows: list[Mapping], strategies: list[str]) -> dict[str, tuple[str, int, int]]:
    """{strategy: (an earlier strategy, points where both metrics equal it, points in common)} for
    each strategy whose points coincide with an earlier one's somewhere (it is drawn over it)."""
    at = {(r["model"], r.get("ep", 1), r["W"], r["strategy"]): (r["bytes_over_bound"], r["modelled_s"]) for r in rows}
    out = {}
    for k, s in enumerate(strategies):
        best = None
        for earlier in strategies[:k]:
            common = [(key, at[key[:3] + (earlier,)]) for key in at if key[3] == s and key[:3] + (earlier,) in at]
            equal = sum(all(_coincide(x, y) for x, y in zip(at[key], other)) for key, other in common)
            if equal and (best is None or equal > best[1]):
                best = (earlier, equal, len(common))
        if best:
            out[s] = best
    return out


def plot_strategy_sweep(rows: Iterable[Mapping], ax=None, *, title: str = "strategies vs world size"):
    """Total bytes / lower bound and modelled optimizer time against world size, per strategy.

    ``rows``: ``summarize()`` dicts with keys ``model``, ``W`` and ``strategy`` added (and ``ep``
    if it varies). Colour, marker and line width say the strategy, line style the model (and ep).
    Strategies sit a few percent apart along x, and one whose points equal another's says so in
    the legend, so coinciding lines stay told apart. Log x; the y axes turn log when the values
    span more than a factor 20. ``ax``: None or a pair of axes (bytes ratio, time). Returns the pair.
    """
    rows = list(rows)
    for r in rows:
        missing = {"model", "W", "strategy", "bytes_over_bound", "modelled_s"} - set(r)
        if missing:
            raise ValueError(f"sweep row lacks {sorted(missing)}: add model/W/strategy to summarize()'s dict")
    if ax is None:
        _, ax = plt.subplots(1, 2, figsize=(11, 3.6))
    ax_ratio, ax_time = ax
    models = list(dict.fromkeys((r["model"], r.get("ep", 1)) for r in rows))
    many_ep = len({m[1] for m in models}) > 1
    strategies = list(dict.fromkeys(r["strategy"] for r in rows))
    for (model, ep) in models:
        style = MODEL_LINESTYLES[models.index((model, ep)) % len(MODEL_LINESTYLES)]
        for k, s in enumerate(strategies):
            pts = sorted((r["W"], r["bytes_over_bound"], r["modelled_s"]) for r in rows
                         if r["model"] == model and r.get("ep", 1) == ep and r["strategy"] == s)
            if not pts:
                continue
            # a few percent apart on the log2 x axis: equal values put markers side by side
            shift = 2 ** (0.045 * (k - (len(strategies) - 1) / 2))
            xs = [p[0] * shift for p in pts]
            kw = dict(STRATEGY_STYLES.get(s, _OTHER_STYLE), ls=style, zorder=2 + k)
            ax_ratio.plot(xs, [p[1] for p in pts], **kw)
            ax_time.plot(xs, [1e3 * p[2] for p in pts], **kw)
    for target, label in ((ax_ratio, "total bytes / lower bound"), (ax_time, "modelled optimizer ms per step")):
        target.set_xscale("log", base=2)
        target.set_xlabel("world size W")
        target.set_ylabel(label)
        ys = [y for line in target.get_lines() for y in line.get_ydata() if y > 0]
        if ys and max(ys) / min(ys) > 20:
            target.set_yscale("log")
        target.grid(alpha=0.3, which="both")
    worlds = sorted({r["W"] for r in rows})
    if worlds:
        ax_ratio.set_xticks(worlds, [str(W) for W in worlds])
        ax_time.set_xticks(worlds, [str(W) for W in worlds])
    if any(r["bytes_over_bound"] for r in rows):
        ax_ratio.axhline(1.0, color="0.5", lw=0.8, ls=(0, (1, 2)))
    ax_ratio.set_title(f"{title}: bytes over the bound", fontsize=11)
    ax_time.set_title(f"{title}: modelled time", fontsize=11)
    ties = _ties(rows, strategies)

    def label(s):
        if s not in ties:
            return s
        other, equal, common = ties[s]
        return f"{s} (= {other} {'everywhere' if equal == common else f'at {equal} of {common} points'})"

    handles = [Line2D([], [], **STRATEGY_STYLES.get(s, _OTHER_STYLE), label=label(s)) for s in strategies]
    if len(models) > 1 or many_ep:
        handles += [Line2D([], [], color="0.3", ls=MODEL_LINESTYLES[i % len(MODEL_LINESTYLES)],
                           label=f"{m} (ep={ep})" if many_ep else m) for i, (m, ep) in enumerate(models)]
    ax_time.legend(handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    return ax_ratio, ax_time


# ---------------------------------------------------------------- the interactive planner

def _takes_experts(shapes_fn: Callable) -> bool:
    return "experts" in inspect.signature(shapes_fn).parameters


def _shapes(shapes_fn: Callable, layers: int, experts: int | None) -> list:
    kwargs = {"layers": layers}
    if experts is not None and _takes_experts(shapes_fn):
        kwargs["experts"] = experts
    return shapes_fn(**kwargs)


def _mesh(world: int, ep: int):
    if world < 1 or ep < 1 or world % ep:
        raise ValueError(f"ep={ep} must divide the world size {world}")
    return world if ep == 1 else (world // ep, ep)


@functools.lru_cache(maxsize=32)
def _plan(shapes_fn: Callable, layers: int, experts: int | None, world: int, ep: int, strategy: str, profile):
    """One simulated plan, kept for a while: plans at thousands of ranks weigh megabytes, so only the
    last few are (the per-rank row needs one; the sweep only their summaries)."""
    return simulate(_shapes(shapes_fn, layers, experts), _mesh(world, ep), strategy=strategy, profile=profile)


@functools.lru_cache(maxsize=4096)
def _summary(shapes_fn: Callable, layers: int, experts: int | None, world: int, ep: int, strategy: str,
             profile) -> dict:
    """``summarize`` of that plan, kept: a panel revisits the same configurations as its controls move
    (the sweep is the same for every world size and strategy of the per-rank row)."""
    return summarize(_plan(shapes_fn, layers, experts, world, ep, strategy, profile), world, profile)


def clear_plan_cache() -> None:
    """Forget the plans and summaries the panel kept (e.g. after changing a shapes function's body)."""
    _plan.cache_clear()
    _summary.cache_clear()


def simulate_views(shapes_fn: Callable, *, world: int, ep: int = 1, experts: int | None = None,
                   layers: int = 4, profile: str = "h100_node", strategy: str = "muonlab",
                   sweep_worlds: Sequence[int] = DEFAULT_SWEEP, sweep_strategies: Sequence[str] | None = None,
                   model: str | None = None, fig=None) -> dict:
    """Simulate one configuration and a sweep of world sizes, and draw both: the panel's callback.

    ``shapes_fn(layers=..., experts=...)`` returns (name, shape) pairs (``experts`` is passed only
    if it takes it). Top row: ``plot_plan_per_rank`` of ``strategy`` at ``world`` ranks on mesh
    (world // ep, ep). Bottom row: ``plot_strategy_sweep`` of every strategy at ``sweep_worlds``
    (those ``ep`` divides). Returns dict(plan, summary (one summarize() row per strategy at
    ``world``), sweep (rows), figure). Raises ValueError for a mesh that doesn't fit.
    Summaries are kept per (shapes_fn, layers, experts, world, ep, strategy, profile), and the last
    few plans, so a configuration seen before is drawn without simulating it again (see
    ``clear_plan_cache``).
    """

    if strategy not in SIMULATED_STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {SIMULATED_STRATEGIES}")
    model = model or getattr(shapes_fn, "__name__", "model")
    experts = experts if _takes_experts(shapes_fn) else None
    sweep_strategies = tuple(sweep_strategies or SIMULATED_STRATEGIES)
    _mesh(world, ep)

    def row(W, s):
        return dict(_summary(shapes_fn, layers, experts, W, ep, s, profile), model=model, W=W, ep=ep, strategy=s)

    summary = [row(world, s) for s in dict.fromkeys((strategy,) + sweep_strategies)]
    sweep = [row(W, s) for W in sorted(set(sweep_worlds)) if W % ep == 0 for s in sweep_strategies]
    plan = _plan(shapes_fn, layers, experts, world, ep, strategy, profile)  # the one drawn per rank
    own_figure = fig is None
    if own_figure:
        fig = plt.figure(figsize=(11.5, 7))
    fig.clear()
    axes = fig.subplots(2, 2)
    mesh_text = f"W={world}" + (f" = fsdp {world // ep} x ep {ep}" if ep > 1 else "")
    try:
        plot_plan_per_rank(plan, world, ax=axes[0], title=f"{strategy}, {mesh_text}")
        plot_strategy_sweep(sweep, ax=axes[1], title="strategies")
    except Exception:
        if own_figure:  # a half-drawn figure would otherwise appear under the cell
            plt.close(fig)
        raise
    layers_text = f"{layers} layers" + (f", {experts} experts" if experts else "")
    fig.suptitle(f"{model} ({layers_text}), {profile}" + (f", ep={ep}" if ep > 1 else ""), fontsize=12)
    # fixed margins (room for the legends on the right): tight_layout measured every label and
    # cost about half a second per redraw
    fig.subplots_adjust(left=0.07, right=0.80, bottom=0.08, top=0.9, wspace=0.32, hspace=0.42)
    return dict(plan=plan, summary=summary, sweep=sweep, figure=fig)


def _summary_html(rows: Sequence[Mapping]) -> str:
    head = ("<tr><th>strategy</th><th>paths</th><th>bytes / bound</th><th>max-rank MB</th>"
            "<th>FLOP imbalance</th><th>modelled ms</th><th>batches</th></tr>")
    body = "".join(
        f"<tr><td>{r['strategy']}</td><td>{', '.join(r['paths'])}</td><td>{r['bytes_over_bound']:.3f}</td>"
        f"<td>{r['max_rank_bytes'] / 1e6:.1f}</td><td>{r['flop_imbalance']:.3f}</td>"
        f"<td>{1e3 * r['modelled_s']:.2f}</td><td>{r['batches']}</td></tr>" for r in rows)
    return f"<table style='font-size:12px'>{head}{body}</table>"


class PlannerPanel:
    """World size, ep, experts, layers, hardware profile and strategy; every change re-simulates.

    ``callback(world=, ep=, experts=, layers=, profile=, strategy=)`` is a plain function (a
    ``simulate_views`` call with this panel's shapes and sweep): call it directly in a cell to run
    without a frontend. ``update()`` runs it with the widgets' values and redraws the panel.
    """

    def __init__(self, shapes_fn: Callable, *, world: int = 64, ep: int = 1, experts: int | None = 64,
                 layers: int = 4, profile: str = "h100_node", strategy: str = "muonlab",
                 worlds: Sequence[int] = DEFAULT_SWEEP, sweep_worlds: Sequence[int] | None = None,
                 eps: Sequence[int] = (1, 2, 4, 8, 16), max_layers: int = 64, model: str | None = None,
                 auto: bool = True):
        import ipywidgets as w

        from ..comm.cost import PROFILES

        worlds = sorted(set(worlds))
        if world not in worlds:
            raise ValueError(f"world={world} is not among the panel's world sizes {worlds}")
        if ep not in eps:
            raise ValueError(f"ep={ep} is not among the panel's ep choices {list(eps)}")
        takes_experts = _takes_experts(shapes_fn)
        # before any widget exists: a slider would clamp these silently, a dropdown raise a TraitError
        # naming neither the argument nor the choices
        check_range("layers", layers, 1, max_layers, integer=True, what="the layers slider (1 to max_layers)")
        if takes_experts:  # a shapes_fn without experts is never passed it: any value is fine there
            check_range("experts", experts, 1, math.inf, integer=True, what="the expert counts a model can have")
        check_choice("profile", profile, sorted(PROFILES))
        check_choice("strategy", strategy, SIMULATED_STRATEGIES)
        self.shapes_fn = shapes_fn
        self.model = model or getattr(shapes_fn, "__name__", "model")
        self.sweep_worlds = tuple(sweep_worlds or worlds)
        style = {"description_width": "90px"}
        self.world = w.SelectionSlider(options=worlds, value=world, description="world size", style=style,
                                       continuous_update=False)
        self.ep = w.Dropdown(options=list(eps), value=ep, description="ep", style=style)
        expert_choices = sorted({2 ** k for k in range(1, 10)} | ({experts} if takes_experts else set()))
        self.experts = w.Dropdown(options=expert_choices, value=experts if takes_experts else 64,
                                  description="experts", style=style, disabled=not takes_experts)
        self.layers = w.IntSlider(value=layers, min=1, max=max_layers, description="layers", style=style,
                                  continuous_update=False)
        self.profile = w.Dropdown(options=sorted(PROFILES), value=profile, description="hardware", style=style)
        self.strategy = w.Dropdown(options=list(SIMULATED_STRATEGIES), value=strategy, description="per-rank plot",
                                   style=style)
        self.status = w.HTML("")
        self.table = w.HTML("")
        self.output = w.Output()
        self.last: dict | None = None
        controls = [self.world, self.ep, self.experts, self.layers, self.profile, self.strategy]
        if auto:
            for c in controls:
                c.observe(lambda _change: self.update(), names="value")
        self.widget = w.VBox([w.HBox([w.VBox(controls[:3]), w.VBox(controls[3:])]), self.status,
                              self.table, self.output])

    def callback(self, *, world: int, ep: int = 1, experts: int | None = None, layers: int = 4,
                 profile: str = "h100_node", strategy: str = "muonlab") -> dict:
        """Simulate and draw one configuration (see ``simulate_views``); returns its dict."""
        return simulate_views(self.shapes_fn, world=world, ep=ep, experts=experts, layers=layers,
                              profile=profile, strategy=strategy, sweep_worlds=self.sweep_worlds,
                              model=self.model)

    def values(self) -> dict:
        """The callback's keyword arguments as the widgets hold them now."""
        return dict(world=int(self.world.value), ep=int(self.ep.value),
                    experts=None if self.experts.disabled else int(self.experts.value),
                    layers=int(self.layers.value), profile=self.profile.value, strategy=self.strategy.value)

    def update(self, _button=None) -> dict | None:
        """Run the callback with the widgets' values and redraw. An error (a mesh that doesn't fit,
        or any other) clears the previous figure and table and shows in the status line."""
        v = self.values()
        self.status.value = "simulating ..."
        try:
            result = self.callback(**v)
        except Exception as e:  # the panel shows it; nothing stale stays next to it
            self.output.outputs = ()
            self.table.value = ""
            self.last = None
            self.status.value = f"<span style='color:#b00'>{html.escape(f'{type(e).__name__}: {e}')}</span>"
            return None
        show_figure(self.output, result["figure"], "planner figure")
        self.table.value = _summary_html(result["summary"])
        self.status.value = (f"{self.model}: {v['layers']} layers" + (f", {v['experts']} experts" if v["experts"] else "")
                             + f", W={v['world']}, ep={v['ep']}, {v['profile']}")
        self.last = result
        return result

    def _repr_mimebundle_(self, **kwargs):
        if self.last is None:
            self.update()
        return self.widget._repr_mimebundle_(**kwargs)


def planner_panel(shapes_fn: Callable = moe_shapes, **kwargs) -> PlannerPanel:
    """Build a ``PlannerPanel`` around ``shapes_fn(layers=..., experts=...)`` (e.g. ``moe_shapes``,
    ``dense_shapes``). Display it as the last expression of a cell; ``panel.callback(...)`` runs one
    configuration without a frontend, ``panel.update()`` one with the widgets' values."""
    return PlannerPanel(shapes_fn, **kwargs)
