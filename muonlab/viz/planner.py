"""Views of the planner: per-rank bytes and FLOPs of one plan, strategies across world sizes, and
an ipywidgets panel that re-simulates as the mesh or the model changes.

Everything here reads ``muonlab.comm.records`` only: a ``Plan`` (or its ``BatchPlan`` list, as
``Muon.plan()`` and ``train_worker`` return it) and ``summarize()`` rows. Nothing is launched: the
panel's plans come from ``simulate``, the same planner a real step runs.

    from muonlab.viz.planner import planner_panel, moe_shapes
    panel = planner_panel(moe_shapes)   # display it; panel.callback(world=64, ...) runs it directly
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping, Sequence

import matplotlib.pyplot as plt
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from ..comm.records import per_rank
from ..simulate import SIMULATED_STRATEGIES, simulate, summarize
from .timeline import _ordered_paths, _path_color

__all__ = ["PlannerPanel", "dense_shapes", "moe_shapes", "planner_panel", "plot_plan_per_rank",
           "plot_strategy_sweep", "simulate_views"]

STRATEGY_STYLES = {"muonlab": dict(color="#1f77b4", marker="o"),
                   "padded_all_to_all": dict(color="#ff7f0e", marker="s"),
                   "xtuner": dict(color="#2ca02c", marker="^")}
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

def _scale(top: float, units: Sequence[tuple[float, str]]) -> tuple[float, str]:
    for factor, name in reversed(units):
        if top >= factor:
            return factor, name
    return units[0]


_BYTE_UNITS = ((1, "B"), (2 ** 10, "KiB"), (2 ** 20, "MiB"), (2 ** 30, "GiB"))
_FLOP_UNITS = ((1, "FLOP"), (1e6, "MFLOP"), (1e9, "GFLOP"), (1e12, "TFLOP"))


def _stacked(ax, per: dict[str, dict[str, list[int]]], key: str, world: int, units) -> list[str]:
    paths = [p for p in _ordered_paths(per) if any(per[p][key])]
    totals = [sum(per[p][key][g] for p in paths) for g in range(world)]
    factor, unit = _scale(max(totals, default=0), units)
    bottom = [0.0] * world
    xs = list(range(world))
    for p in paths:
        vals = [v / factor for v in per[p][key]]
        if world <= 64:
            ax.bar(xs, vals, bottom=bottom, color=_path_color(p), width=0.8, edgecolor="white", lw=0.5)
        else:  # thousands of ranks: a line per rank stays visible (>= 1 px) where a bar would not
            top = [b + v for b, v in zip(bottom, vals)]
            keep = [g for g in xs if vals[g]]
            ax.vlines(keep, [bottom[g] for g in keep], [top[g] for g in keep], color=_path_color(p), lw=1.2)
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
    (bytes, FLOPs). Up to 64 ranks are bars; more are drawn as filled steps. Returns the pair.
    """
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    batches = list(plan)
    if ax is None:
        _, ax = plt.subplots(1, 2, figsize=(11, 3.4))
    ax_bytes, ax_flops = ax
    per = per_rank(batches, world, by_path=True)
    seen = _stacked(ax_bytes, per, "sent", world, _BYTE_UNITS)
    seen += [p for p in _stacked(ax_flops, per, "flops", world, _FLOP_UNITS) if p not in seen]
    ax_bytes.set_ylabel(ax_bytes.get_ylabel() + " sent per step")
    ax_flops.set_ylabel(ax_flops.get_ylabel() + " Newton-Schulz per step")
    ax_bytes.set_title(f"{title}: bytes sent per rank", fontsize=10)
    ax_flops.set_title(f"{title}: Newton-Schulz FLOPs per rank", fontsize=10)
    paths = _ordered_paths(seen or {b.path for b in batches})
    if paths:
        ax_flops.legend(handles=[Patch(facecolor=_path_color(p), label=p) for p in paths], fontsize=8,
                        loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    return ax_bytes, ax_flops


# ---------------------------------------------------------------- strategies across world sizes

def plot_strategy_sweep(rows: Iterable[Mapping], ax=None, *, title: str = "strategies vs world size"):
    """Total bytes / lower bound and modelled optimizer time against world size, per strategy.

    ``rows``: ``summarize()`` dicts with keys ``model``, ``W`` and ``strategy`` added (and ``ep``
    if it varies). Colour and marker say the strategy, line style the model (and ep). Log x; the
    y axes turn log when the values span more than a factor 20. ``ax``: None or a pair of axes
    (bytes ratio, time). Returns the pair.
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
        for s in strategies:
            pts = sorted((r["W"], r["bytes_over_bound"], r["modelled_s"]) for r in rows
                         if r["model"] == model and r.get("ep", 1) == ep and r["strategy"] == s)
            if not pts:
                continue
            kw = dict(STRATEGY_STYLES.get(s, dict(color="0.4", marker="x")), ls=style, ms=4, lw=1.4)
            ax_ratio.plot([p[0] for p in pts], [p[1] for p in pts], **kw)
            ax_time.plot([p[0] for p in pts], [1e3 * p[2] for p in pts], **kw)
    for target, label in ((ax_ratio, "total bytes / lower bound"), (ax_time, "modelled optimizer ms per step")):
        target.set_xscale("log", base=2)
        target.set_xlabel("world size W")
        target.set_ylabel(label)
        ys = [y for line in target.get_lines() for y in line.get_ydata() if y > 0]
        if ys and max(ys) / min(ys) > 20:
            target.set_yscale("log")
        target.grid(alpha=0.3, which="both")
    if any(r["bytes_over_bound"] for r in rows):
        ax_ratio.axhline(1.0, color="0.5", lw=0.8, ls=(0, (1, 2)))
    ax_ratio.set_title(f"{title}: bytes over the bound", fontsize=10)
    ax_time.set_title(f"{title}: modelled time", fontsize=10)
    handles = [Line2D([], [], lw=1.4, **STRATEGY_STYLES.get(s, dict(color="0.4", marker="x")), label=s)
               for s in strategies]
    if len(models) > 1 or many_ep:
        handles += [Line2D([], [], color="0.3", ls=MODEL_LINESTYLES[i % len(MODEL_LINESTYLES)],
                           label=f"{m} (ep={ep})" if many_ep else m) for i, (m, ep) in enumerate(models)]
    ax_time.legend(handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    return ax_ratio, ax_time


# ---------------------------------------------------------------- the interactive planner

def _shapes(shapes_fn: Callable, layers: int, experts: int | None) -> list:
    params = inspect.signature(shapes_fn).parameters
    kwargs = {"layers": layers}
    if experts is not None and "experts" in params:
        kwargs["experts"] = experts
    return shapes_fn(**kwargs)


def _mesh(world: int, ep: int):
    if world < 1 or ep < 1 or world % ep:
        raise ValueError(f"ep={ep} must divide the world size {world}")
    return world if ep == 1 else (world // ep, ep)


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
    """

    if strategy not in SIMULATED_STRATEGIES:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {SIMULATED_STRATEGIES}")
    model = model or getattr(shapes_fn, "__name__", "model")
    shapes = _shapes(shapes_fn, layers, experts)
    sweep_strategies = tuple(sweep_strategies or SIMULATED_STRATEGIES)
    mesh = _mesh(world, ep)

    def row(W, s):
        plan = simulate(shapes, _mesh(W, ep), strategy=s, profile=profile)
        return plan, dict(summarize(plan, W, profile), model=model, W=W, ep=ep, strategy=s)

    summary, plan = [], None
    for s in dict.fromkeys((strategy,) + sweep_strategies):
        p, r = row(world, s)
        summary.append(r)
        plan = p if s == strategy else plan
    done = {(r["W"], r["strategy"]): r for r in summary}
    sweep = []
    for W in sorted(set(sweep_worlds)):
        if W % ep:
            continue
        for s in sweep_strategies:
            sweep.append(done.get((W, s)) or row(W, s)[1])
    if fig is None:
        fig = plt.figure(figsize=(11.5, 7))
    fig.clear()
    axes = fig.subplots(2, 2)
    mesh_text = f"W={world}" + (f" = fsdp {world // ep} x ep {ep}" if ep > 1 else "")
    plot_plan_per_rank(plan, world, ax=axes[0], title=f"{strategy}, {mesh_text}")
    plot_strategy_sweep(sweep, ax=axes[1], title="strategies")
    layers_text = f"{layers} layers" + (f", {experts} experts" if experts and "experts" in
                                        inspect.signature(shapes_fn).parameters else "")
    fig.suptitle(f"{model} ({layers_text}), {profile}" + (f", ep={ep}" if ep > 1 else ""), fontsize=11)
    fig.tight_layout()
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
        self.shapes_fn = shapes_fn
        self.model = model or getattr(shapes_fn, "__name__", "model")
        self.sweep_worlds = tuple(sweep_worlds or worlds)
        takes_experts = "experts" in inspect.signature(shapes_fn).parameters
        style = {"description_width": "90px"}
        self.world = w.SelectionSlider(options=worlds, value=world, description="world size", style=style,
                                       continuous_update=False)
        self.ep = w.Dropdown(options=list(eps), value=ep, description="ep", style=style)
        expert_choices = sorted({2 ** k for k in range(1, 10)} | ({experts} if experts else set()))
        self.experts = w.Dropdown(options=expert_choices, value=experts if takes_experts and experts else 64,
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
        """Run the callback with the widgets' values and redraw; a bad mesh shows in the status."""
        from IPython.display import display

        v = self.values()
        self.status.value = "simulating ..."
        try:
            result = self.callback(**v)
        except ValueError as e:
            self.status.value = f"<span style='color:#b00'>{e}</span>"
            return None
        fig = result["figure"]
        self.output.clear_output(wait=True)
        with self.output:
            display(fig)
        plt.close(fig)  # the inline backend would otherwise draw it a second time under the cell
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
