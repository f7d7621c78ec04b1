"""What distributed optimizer steps did: per-rank timelines of one or many steps, where their time
went (exposed and overlapped communication), bytes per path, the plan's loads.

Everything here only reads what the workers recorded: spans (``muonlab.trace.Span`` or their
``asdict`` rows, of one step or numbered by a ``muonlab.trace.StepRecorder``),
``Muon.last_step_stats()`` dicts and plan rows (``BatchPlan.as_row()``, with the per-rank
``bytes_sent`` / ``flops`` lists that ``muonlab.experiments.train.plan_rows`` adds).
"""

from __future__ import annotations

from collections.abc import Mapping

import matplotlib

matplotlib.use(matplotlib.get_backend())  # keep the notebook's backend; Agg when headless
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from ..comm import records  # noqa: E402
from ..comm.paths import PATHS  # noqa: E402
from ..trace.spans import LANES, OPTIMIZER_COMM, span_rows  # noqa: E402
from ..trace.step_time import exposed_comm_table, per_step, select_steps  # noqa: E402
from ..trace.steps import CLOCKS  # noqa: E402
from ..trace.ns_choice import ns_choice_label  # noqa: E402

__all__ = ["BYTE_UNITS", "DISTRIBUTION_ABOVE", "FLOP_UNITS", "PATH_COLORS", "PHASE_COLORS", "plot_bytes_by_path",
           "ns_choice_label", "plot_plan", "plot_rank_distribution", "plot_step_time", "plot_timeline", "scale_for"]

# FSDP2's own collectives of a whole training step (muonlab.trace.whole_step) beside the optimizer's paths
PATH_COLORS = {**{name: path.color for name, path in PATHS.items()},
               "fsdp_all_gather": "#e7ba52", "fsdp_reduce_scatter": "#7b4173"}
# momentum a dark red-brown: tab:brown was padded_all_to_all's colour to within 0.1 per channel;
# forward and backward two blues of one family, away from the paths' blues and the direction swatch
PHASE_COLORS = {"momentum": "#843c39", "newton_schulz": "#9467bd", "update": "#e377c2", "adamw": "#bcbd22",
                "forward": "#6b6ecf", "backward": "#5254a3", "optimizer": "#8ca252"}
_OTHER = "#000000"
_DIRECTION = "#3a3a5a"  # the direction swatches' fill: unlike black (_OTHER) and every path's colour
_HATCH = {"comm_out": "", "comm_back": "////"}
DISTRIBUTION_ABOVE = 64
"""Per-rank views of more ranks than this are drawn as a distribution: a bar per rank would be
under a pixel wide at 2048 ranks."""


def _path_color(path: str) -> str:
    return PATH_COLORS.get(path, _OTHER)


def _pack(spans: list[dict]) -> list[int]:
    """Greedy interval packing: a track per span so that spans on one track don't overlap."""
    track_end: list[float] = []
    tracks = [0] * len(spans)
    for i in sorted(range(len(spans)), key=lambda i: (spans[i]["start"], spans[i]["end"])):
        s = spans[i]
        for t, end in enumerate(track_end):
            if end <= s["start"]:
                break
        else:
            t = len(track_end)
            track_end.append(0.0)
        track_end[t] = s["end"]
        tracks[i] = t
    return tracks


def _step_offsets(rows: list[dict]) -> tuple[dict[int, float], list[tuple[int, float, float]]]:
    """Steps laid end to end: {step: seconds to subtract from its times} and, per step, (step, x
    of its start, x of its end) in seconds on the drawn axis. Every rank of a step shares its
    shift, so ranks stay aligned; the time between steps is cut to a small gap."""
    extent: dict[int, list[float]] = {}
    for r in rows:
        e = extent.setdefault(r["step"], [r["start"], r["end"]])
        e[0], e[1] = min(e[0], r["start"]), max(e[1], r["end"])
    widths = sorted(e[1] - e[0] for e in extent.values())
    gap = 0.06 * widths[len(widths) // 2] if len(extent) > 1 else 0.0
    shift, placed, x = {}, [], 0.0
    for step in sorted(extent):
        start, end = extent[step]
        shift[step] = start - x
        placed.append((step, x, x + end - start))
        x += end - start + gap
    return shift, placed


def plot_timeline(spans, ax=None, *, title: str | None = None, label_batches: bool = True, steps=None,
                  choices=None, clock: str | None = None):
    """Gantt chart of one or several optimizer steps: a band per rank, compute on top,
    communication below.

    Compute spans are coloured by phase. Communication spans are coloured by path, solid on the way
    out and hatched on the way back; spans that moved no bytes on this rank are dashed outlines.
    A comm span lasts from the collective's start to the end of its wait, so batches in flight
    together overlap; they are stacked on separate tracks. Bars wide enough carry their plan batch.
    Whole training steps (``muonlab.trace.WholeStepRecorder``) add forward and backward on top and
    FSDP2's all-gathers and reduce-scatters below, coloured as paths (they count no bytes, so they
    are never outlined).

    ``spans``: ``Span``s or rows; of one step (``Muon.last_step_spans()``) or of several, numbered
    by their ``step`` (``muonlab.trace.StepRecorder``). Several steps are laid end to end, each
    from its first span, with the time between them (forward, backward, data) cut, and labelled.
    ``steps``: which to draw: None every step, an int the last k, or a list of step numbers.
    ``choices``: ``Muon.resolved_choices()``: the Newton-Schulz form, dtype and backend go in the
    title (``ns_choice_label``). ``clock``: "gpu" or "host" (``StepRecorder.clock``), named in the
    title. Times are ms.
    """
    rows = select_steps(span_rows(spans), steps)
    shift, placed = _step_offsets(rows) if rows else ({}, [])
    several = len(placed) > 1
    whole = _whole_steps(rows)
    kind = "training" if whole else "optimizer"
    if title is None:
        title = f"{len(placed)} {kind} steps, per rank" if several else f"one {kind} step, per rank"
    if ax is None:
        width = min(22.0, 11.0 + 0.9 * max(0, len(placed) - 1))
        _, ax = plt.subplots(figsize=(width, 1.3 + 1.1 * max(1, len({r["rank"] for r in rows}))))
    if not rows:
        ax.set_title(title + " (no spans)")
        return ax
    ranks = sorted({r["rank"] for r in rows})
    compute_h, gap = 0.28, 0.04
    comm_total = 1.0 - compute_h - 3 * gap  # band of one rank spans [y, y + 1)
    phases_seen, paths_seen, dirs_seen = [], [], set()
    span_ms = placed[-1][2] * 1e3 or 1.0
    min_label = 0.02 * span_ms  # narrower bars carry no batch number: it would spill over

    def x_ms(r: dict) -> tuple[float, float]:
        return (r["start"] - shift[r["step"]]) * 1e3, (r["end"] - r["start"]) * 1e3

    def label(x: float, y: float, text: str, color: str) -> None:
        # white digits on a patch of the bar's own colour: legible over hatching and on outlines
        ax.text(x, y, text, ha="center", va="center", fontsize=6.5, color="white",
                bbox=dict(boxstyle="round,pad=0.12", facecolor=color, edgecolor="none"))

    bars: dict[tuple, list[tuple[float, float]]] = {}  # (y, height, face, edge, hatch, lw, ls) -> bars
    for k, rank in enumerate(ranks):
        # rank 0 at the top
        base = len(ranks) - 1 - k
        mine = [r for r in rows if r["rank"] == rank]
        comm = [r for r in mine if LANES.get(r["name"], "compute") == "comm"]
        compute = [r for r in mine if LANES.get(r["name"], "compute") != "comm"]
        y_compute = base + 1 - gap - compute_h
        for r in compute:
            start, width = x_ms(r)
            color = PHASE_COLORS.get(r["name"], _OTHER)
            bars.setdefault((y_compute, compute_h, color, "white", "", 0.5, "-"), []).append((start, width))
            if r["name"] not in phases_seen:
                phases_seen.append(r["name"])
            if label_batches and r["batch"] >= 0 and width > min_label:
                label(start + width / 2, y_compute + compute_h / 2, str(r["batch"]), color)
        # packed per step: a track per overlap within a step (steps never overlap on the axis)
        tracks = _pack([dict(r, start=x_ms(r)[0], end=sum(x_ms(r))) for r in comm])
        num_tracks = max(tracks, default=0) + 1
        track_h = comm_total / num_tracks
        for r, t in zip(comm, tracks):
            start, width = x_ms(r)
            color = _path_color(r["path"])
            # only the optimizer's batches count their bytes: FSDP2's collectives record none
            moved = r["bytes_sent"] or r["bytes_recv"] or r["name"] not in OPTIMIZER_COMM
            y = base + gap + (num_tracks - 1 - t) * track_h
            style = (color, "white", _HATCH.get(r["name"], ""), 0.6, "-") if moved else \
                ("none", color, _HATCH.get(r["name"], ""), 0.9, (0, (2, 1.5)))
            bars.setdefault((y, track_h * 0.9, *style), []).append((start, width))
            if label_batches and r["batch"] >= 0 and width > min_label and track_h >= 0.12:
                label(start + width / 2, y + track_h * 0.45, str(r["batch"]), color)
            if r["path"] and r["path"] not in paths_seen:
                paths_seen.append(r["path"])
            dirs_seen.add(r["name"])
        if k:
            ax.axhline(base + 1, color="0.8", lw=0.6)
    for (y, h, face, edge, hatch, lw, ls), xs in bars.items():  # one collection per style and track:
        # a call per bar took ~10 s for 50 steps of 4 ranks
        ax.broken_barh(xs, (y, h), facecolors=face, edgecolor=edge, hatch=hatch, lw=lw, linestyle=ls)
    ax.set_ylim(0, len(ranks))
    ax.set_yticks([len(ranks) - 1 - k + 0.5 for k in range(len(ranks))])
    ax.set_yticklabels([f"rank {r}" for r in ranks])
    ax.tick_params(axis="y", length=0)
    ax.set_xlim(0, span_ms * 1.01)
    if several:
        every = -(-len(placed) // 14)  # at most about 14 step labels, so they never touch
        for i, (step, x0, x1) in enumerate(placed):
            if i:
                ax.axvline(x0 * 1e3 - 0.5 * (x0 - placed[i - 1][2]) * 1e3, color="0.35", lw=0.9, ls=(0, (4, 2)))
            if i % every == 0:
                ax.text((x0 + x1) / 2 * 1e3, 1.0, f"step {step}", transform=ax.get_xaxis_transform(),
                        ha="center", va="bottom", fontsize=7.5, color="0.25")
        between = "data" if whole else "forward/backward/data"
        ax.set_xlabel(f"ms within each step, steps laid end to end (dashed: the time between steps, {between}, "
                      "cut out)")
    else:
        ax.set_xlabel("ms from the first span of the step")
    head = title + "  (top of each band: compute; bottom: communication)"
    if clock is not None:
        head += f"; {CLOCKS.get(clock, clock)}"
    if choices is not None:
        head += "\n" + ns_choice_label(choices)
    ax.set_title(head, fontsize=10, pad=14 if several else 6)
    ax.grid(axis="x", alpha=0.3)

    handles = [Patch(facecolor=PHASE_COLORS.get(p, _OTHER), label=p) for p in phases_seen]
    handles += [Patch(facecolor=_path_color(p), label=f"comm: {p}") for p in paths_seen]
    # direction and bytes in a dark grey (no path's colour: the local path is mid grey), each
    # swatch unlike the others: solid, hatched, dashed outline
    if "comm_out" in dirs_seen:
        handles.append(Patch(facecolor=_DIRECTION, edgecolor=_DIRECTION, label="out (solid)"))
    if "comm_back" in dirs_seen:
        handles.append(Patch(facecolor=_DIRECTION, edgecolor="white", hatch="////", label="back (hatched)"))
    if any(not (r["bytes_sent"] or r["bytes_recv"]) for r in rows if r["name"] in OPTIMIZER_COMM):
        handles.append(Patch(facecolor="none", edgecolor="0.3", linestyle=(0, (2, 1.5)), lw=0.9,
                             label="no bytes on this rank"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    return ax


def plot_step_time(spans, axes=None, *, steps=None, title: str | None = None, clock: str | None = None):
    """Where the step time of many steps went, per rank (``muonlab.trace.step_time``).

    Left: per rank and path, the median communication per step split into its exposed part (solid,
    with the min-max over steps as an error bar) and its part overlapped by compute (pale), the
    overlap share written above. Right: each rank's exposed communication (solid) and spanned step
    time (dotted) step by step: the step-to-step variation. ``steps``: which steps count (as
    ``plot_timeline``'s, e.g. ``range(1, n)`` to leave out a first step that built the plan).
    ``axes``: None or a pair. Returns the pair.
    """
    table = exposed_comm_table(spans, steps=steps)
    stepwise = per_step(spans, steps=steps)
    if axes is None:  # constrained: the legends beside and below the panels keep their room
        _, axes = plt.subplots(1, 2, figsize=(12, 3.9), gridspec_kw=dict(width_ratios=[1, 1.3]),
                               layout="constrained")
    ax_bars, ax_steps = axes
    paths = _ordered_paths({r["path"] for r in table if r["path"] != "all"})
    if len(paths) > 1:
        paths.append("all")  # the union: paths in flight together count once
    ranks = sorted({r["rank"] for r in table})
    width = 0.8 / max(1, len(paths))
    by_key = {(r["rank"], r["path"]): r for r in table}
    top = 0.0
    for j, path in enumerate(paths):
        color = _path_color(path) if path != "all" else "0.35"
        for k, rank in enumerate(ranks):
            r = by_key.get((rank, path))
            if r is None:
                continue
            x = k + (j - (len(paths) - 1) / 2) * width
            hidden = max(0.0, r["comm_ms"] - r["exposed_ms"])
            ax_bars.bar(x, r["exposed_ms"], width=width * 0.9, color=color)
            ax_bars.bar(x, hidden, bottom=r["exposed_ms"], width=width * 0.9, color=color, alpha=0.3)
            ax_bars.errorbar(x, r["exposed_ms"], yerr=[[r["exposed_ms"] - r["exposed_min_ms"]],
                                                      [r["exposed_max_ms"] - r["exposed_ms"]]],
                             color="0.1", lw=0.9, capsize=2.5)
            share = r["overlap_share"]
            ax_bars.text(x, max(r["exposed_max_ms"], r["exposed_ms"] + hidden), "-" if share is None else
                         f"{100 * share:.0f}%", ha="center", va="bottom", fontsize=7)
            top = max(top, r["exposed_max_ms"], r["exposed_ms"] + hidden)
    ax_bars.set_xticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    ax_bars.set_ylim(0, 1.18 * top or 1.0)
    ax_bars.set_ylabel("ms per step (median)")
    ax_bars.set_title("communication per step: exposed (solid; bar: min-max over steps),\n"
                      "overlapped by compute (pale; % of the communication)", fontsize=9)
    ax_bars.grid(axis="y", alpha=0.3)
    handles = [Patch(facecolor=_path_color(p) if p != "all" else "0.35", label=p) for p in paths]
    handles.append(Patch(facecolor="0.5", alpha=0.3, label="overlapped"))
    ax_bars.legend(handles=handles, fontsize=7.5, loc="upper center", bbox_to_anchor=(0.5, -0.1),
                   ncols=len(handles), frameon=False)

    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for k, rank in enumerate(ranks):
        mine = [s for s in stepwise if s["rank"] == rank]
        xs = [s["step"] for s in mine]
        color = colors[k % len(colors)]
        ax_steps.plot(xs, [s["exposed"].get("all", 0.0) * 1e3 for s in mine], "-o", ms=3, color=color,
                      label=f"rank {rank}")
        ax_steps.plot(xs, [s["spanned"] * 1e3 for s in mine], ":", color=color, lw=1.2)
    ax_steps.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax_steps.set_ylim(bottom=0)
    ax_steps.set_xlabel("step")
    ax_steps.set_ylabel("ms")
    ax_steps.set_title("step by step: exposed communication (solid),\nspanned step time (dotted)", fontsize=9)
    ax_steps.grid(alpha=0.3)
    if ranks:
        ax_steps.legend(fontsize=7.5, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    head = title or f"where the {'training' if _whole_steps(span_rows(spans)) else 'optimizer'} step's time went"
    if clock is not None:
        head += f" ({CLOCKS.get(clock, clock)})"
    ax_bars.figure.suptitle(head, fontsize=11)
    return ax_bars, ax_steps


def _whole_steps(rows: list[dict]) -> bool:
    """The rows are whole training steps (``muonlab.trace.whole_step``), not optimizer steps alone."""
    return any(r["name"] in ("forward", "backward") for r in rows)


def _stats_items(stats_by_rank) -> list[tuple[int, Mapping]]:
    if isinstance(stats_by_rank, Mapping):
        return sorted(stats_by_rank.items())
    return list(enumerate(stats_by_rank))


def _ordered_paths(seen) -> list[str]:
    return [p for p in PATHS if p in seen] + sorted(p for p in seen if p not in PATHS)


def plot_bytes_by_path(stats_by_rank, ax=None, *, which: str = "bytes_sent", title: str | None = None):
    """Bars of the bytes each rank sent (``which="bytes_recv"``: received) per path, in KiB.

    ``stats_by_rank``: ``{rank: opt.last_step_stats()}`` or a list indexed by rank.
    """
    if which not in ("bytes_sent", "bytes_recv"):
        raise ValueError(f"which must be 'bytes_sent' or 'bytes_recv', got {which!r}")
    items = _stats_items(stats_by_rank)
    if ax is None:
        _, ax = plt.subplots(figsize=(6, 3.2))
    paths = _ordered_paths({p for _, s in items for p in s.get(which, {})})
    width = 0.8 / max(1, len(paths))
    for j, path in enumerate(paths):
        xs = [k + (j - (len(paths) - 1) / 2) * width for k in range(len(items))]
        ys = [s.get(which, {}).get(path, 0) / 1024 for _, s in items]
        ax.bar(xs, ys, width=width * 0.95, color=_path_color(path), label=path)
    ax.set_xticks(range(len(items)))
    ax.set_xticklabels([f"rank {r}" for r, _ in items])
    ax.set_ylabel(f"KiB {'sent' if which == 'bytes_sent' else 'received'}")
    ax.set_title(title or f"Muon {'bytes sent' if which == 'bytes_sent' else 'bytes received'} per path, last step")
    if paths:  # beside the axes: inside, it would cover the first rank's bars
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    ax.grid(axis="y", alpha=0.3)
    return ax


BYTE_UNITS = ((1, "B"), (2 ** 10, "KiB"), (2 ** 20, "MiB"), (2 ** 30, "GiB"))
FLOP_UNITS = ((1, "FLOP"), (1e6, "MFLOP"), (1e9, "GFLOP"), (1e12, "TFLOP"))


def scale_for(top: float, units) -> tuple[float, str]:
    """The largest (factor, unit) of ``units`` that ``top`` reaches (the first one if none)."""
    for factor, name in reversed(units):
        if top >= factor:
            return factor, name
    return units[0]


def plot_rank_distribution(ax, stacks: Mapping[str, list[float]], units, *, what: str = "") -> tuple[list[str], str]:
    """Many ranks at once: ranks sorted by their total, largest first, each path's share stacked as
    a filled profile, with the min, median and max of the totals marked.

    ``stacks``: {path: value per global rank}; ``units``: ((factor, name), ...) as ``BYTE_UNITS``.
    Returns the paths drawn and the unit chosen.
    """
    lengths = {p: len(v) for p, v in stacks.items()}
    if len(set(lengths.values())) > 1:
        raise ValueError(f"stacks must hold one value per rank for every path, got lengths {lengths}")
    paths = [p for p in _ordered_paths(stacks) if any(stacks[p])]
    world = max((len(v) for v in stacks.values()), default=0)
    totals = [sum(stacks[p][g] for p in paths) for g in range(world)]
    factor, unit = scale_for(max(totals, default=0), units)
    if not world:
        return paths, unit
    order = sorted(range(world), key=lambda g: (-totals[g], g))
    # position k (1-based) spans [k, k + 1) on a log axis: the few heaviest ranks, usually the
    # story, stay wide, and the long even tail shares the rest
    xs = list(range(1, world + 2))
    bottom = [0.0] * (world + 1)
    for p in paths:
        vals = [stacks[p][g] / factor for g in order]
        top = [b + v for b, v in zip(bottom, vals + vals[-1:])]
        ax.fill_between(xs, bottom, top, step="post", color=_path_color(p), lw=0)
        bottom = top
    ax.set_xscale("log", base=2)
    ax.set_xlim(1, world + 1)
    ticks = [2 ** k for k in range(world.bit_length()) if 2 ** k <= world]
    ticks = ticks[::-(-len(ticks) // 7)]  # at most 7 labels, so four-digit ones never touch
    ax.set_xticks(ticks, [str(t) for t in ticks])
    ax.minorticks_off()
    ax.set_xlabel(f"rank by {what or 'total'}, largest first ({world} ranks, log scale)")
    ax.set_ylabel(unit)
    ax.grid(axis="y", alpha=0.3)
    ranked = sorted(t / factor for t in totals)
    marks = {"max": ranked[-1], "median": ranked[(world - 1) // 2], "min": ranked[0]}
    by_value: dict[float, list[str]] = {}
    for name, v in marks.items():
        by_value.setdefault(v, []).append(name)
    ax.set_ylim(0, 1.2 * (ranked[-1] or 1.0))
    # one line style per statistic, named in one box at the top right (labels on the lines would
    # collide when the values are close)
    styles = {"max": (0, (5, 2)), "median": (0, (3, 1, 1, 1)), "min": (0, (1, 1.5))}
    lines = []
    for v, names in by_value.items():
        ax.axhline(v, color="0.1", lw=0.9, ls=styles[names[0]])
        lines.append(f"{' = '.join(names)}: {v:.3g} {unit}")
    ax.text(0.98, 0.97, "\n".join(lines), transform=ax.transAxes, ha="right", va="top", fontsize=8,
            bbox=dict(facecolor="white", edgecolor="0.7", alpha=0.85, pad=2.5))
    return paths, unit


def _global_row(batch, world: int) -> dict:
    """``batch.as_row()`` with its bytes sent and FLOPs per GLOBAL rank 0..world-1; empty lists for
    a batch with no per-rank FLOPs (per_rank charges such a batch nothing)."""
    if not batch.flops:
        return batch.as_row() | dict(bytes_sent=[], flops=[])
    totals = records.per_rank([batch], world)
    return batch.as_row() | dict(bytes_sent=totals["sent"], flops=totals["flops"])


def plot_plan(plan_rows, ax=None, *, title: str = "plan"):
    """Where the plan puts bytes and Newton-Schulz FLOPs.

    ``plan_rows``: ``BatchPlan`` records (``Muon.plan()``, ``simulate()``,
    ``train_worker(...)["plan_batches"]``), or row dicts. Rows with per-rank ``bytes_sent`` and
    ``flops`` lists: two stacked-bar panels (KiB sent and NS MFLOP per rank), one segment per batch,
    coloured by path and labelled with the batch index; above ``DISTRIBUTION_ABOVE`` ranks, their
    distribution by path (``plot_rank_distribution``). A ``BatchPlan``'s lists are per group-local
    rank; they are mapped to GLOBAL ranks (``muonlab.comm.records.per_rank``), so the bars are the
    global ranks' loads on any mesh. A row dict's lists are drawn index by index as they are
    (``train_worker``'s ``plan`` rows on a 1-D mesh); their non-empty lists must all have one
    length (a ValueError otherwise: rows of groups of different sizes, as on an expert mesh, can't
    be added index by index; pass the ``BatchPlan`` records instead).
    Plain ``as_row()`` rows: per-batch ``max_bytes_sent`` and ``max_flops`` instead.
    ``ax``: None (a new figure) or a pair of axes (bytes, FLOPs). Returns the pair.
    """
    items = list(plan_rows)
    batches = [r for r in items if not isinstance(r, Mapping)]
    # the plan's global ranks: every BatchPlan is drawn over the same ones, whatever its group
    world = len(records.flops_per_rank(batches)) if batches else 0
    rows = [r if isinstance(r, Mapping) else _global_row(r, world) for r in items]
    if ax is None:
        _, ax = plt.subplots(1, 2, figsize=(11, 3.4))
    ax_bytes, ax_flops = ax
    per_rank = bool(rows) and all(isinstance(r.get("bytes_sent"), (list, tuple)) and
                                  isinstance(r.get("flops"), (list, tuple)) for r in rows)
    first_of_length: dict[int, int] = {}  # {per-rank list length: first row with it}
    for i, r in enumerate(rows if per_rank else []):
        if len(r["bytes_sent"]) != len(r["flops"]):
            raise ValueError(f"plan row {i} (batch {r.get('batch', r.get('index', i))}) has {len(r['bytes_sent'])} "
                             f"bytes_sent values and {len(r['flops'])} flops values: one of each per rank")
        if r["flops"]:  # an empty list has no entry for any rank: it adds nothing, whatever the others' length
            first_of_length.setdefault(len(r["flops"]), i)
    if len(first_of_length) > 1:
        found = ", ".join(f"row {i} (batch {rows[i].get('batch', i)}) has {n}" for n, i in first_of_length.items())
        raise ValueError(f"plan rows have per-rank lists of different lengths ({found}): they index the ranks of "
                         "groups of different sizes, which can't be added rank by rank; pass the BatchPlan records "
                         "(train_worker's plan_batches), which are mapped to global ranks")
    num_ranks = max(first_of_length, default=0) if per_rank else 0
    # empty per-rank lists (a plan of local batches, that move nothing) have no rank to draw a bar
    # for: the per-batch view, from the rows' max_bytes_sent / max_flops, instead
    per_rank = per_rank and num_ranks > 0
    if per_rank and num_ranks > DISTRIBUTION_ABOVE:  # batches summed per path: a segment per rank won't show
        for target, key, units, label, what in ((ax_bytes, "bytes_sent", BYTE_UNITS, "sent per step", "bytes sent"),
                                                (ax_flops, "flops", FLOP_UNITS, "Newton-Schulz per step", "FLOPs")):
            stacks: dict[str, list[float]] = {}
            for r in rows:
                acc = stacks.setdefault(r["path"], [0.0] * num_ranks)
                for q, v in enumerate(r[key]):
                    acc[q] += v
            _, unit = plot_rank_distribution(target, stacks, units, what=what)
            target.set_ylabel(f"{unit} {label}")
        ax_bytes.set_title(f"{title}: bytes sent per rank", fontsize=11)
        ax_flops.set_title(f"{title}: NS FLOPs per rank", fontsize=11)
    elif per_rank:
        for target, key, scale in ((ax_bytes, "bytes_sent", 1 / 1024), (ax_flops, "flops", 1e-6)):
            bottom = [0.0] * num_ranks
            top = max(sum(r[key][q] for r in rows if q < len(r[key])) for q in range(num_ranks)) * scale or 1.0
            for r in rows:
                vals = [(r[key][q] if q < len(r[key]) else 0) * scale for q in range(num_ranks)]
                target.bar(range(num_ranks), vals, bottom=bottom, color=_path_color(r["path"]),
                           edgecolor="white", lw=0.8, width=0.7)
                for q, v in enumerate(vals):
                    if v > 0.06 * top:
                        target.text(q, bottom[q] + v / 2, str(r["batch"]), ha="center", va="center",
                                    fontsize=7, color="white")
                bottom = [b + v for b, v in zip(bottom, vals)]
            target.set_xticks(range(num_ranks))
            target.set_xticklabels([f"rank {q}" for q in range(num_ranks)])
        ax_bytes.set_ylabel("KiB sent per step")
        ax_flops.set_ylabel("Newton-Schulz MFLOP per step")
        ax_bytes.set_title(f"{title}: bytes sent per rank", fontsize=11)
        ax_flops.set_title(f"{title}: NS FLOPs per rank", fontsize=11)
    else:
        xs = [r["batch"] for r in rows]
        colors = [_path_color(r["path"]) for r in rows]
        ax_bytes.bar(xs, [r["max_bytes_sent"] / 1024 for r in rows], color=colors)
        ax_flops.bar(xs, [r["max_flops"] * 1e-6 for r in rows], color=colors)
        for target in (ax_bytes, ax_flops):
            target.set_xlabel("batch")
            target.set_xticks(xs)
        ax_bytes.set_ylabel("max KiB sent by one rank")
        ax_flops.set_ylabel("max NS MFLOP on one rank")
        ax_bytes.set_title(f"{title}: bytes per batch", fontsize=11)
        ax_flops.set_title(f"{title}: NS FLOPs per batch", fontsize=11)
    for target in (ax_bytes, ax_flops):
        target.grid(axis="y", alpha=0.3)
    paths = _ordered_paths({r["path"] for r in rows})
    if paths:
        ax_flops.legend(handles=[Patch(facecolor=_path_color(p), label=p) for p in paths], fontsize=8,
                        loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    return ax_bytes, ax_flops
