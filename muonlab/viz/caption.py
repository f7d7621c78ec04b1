"""The caption a figure carries of what produced it: for each run plotted, its record's name and
kind, the optimizer, steps and seeds, and the commit of the code that ran it; for a live run not
saved, the code plotting it now. One line of small grey text at the figure's bottom left, so a
figure saved or pasted elsewhere still says where its curves came from.

Every plot of runs builds its caption here (``caption_runs``); ``add_caption`` puts it on the figure,
replacing the caption a previous plot on the same figure left.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from typing import Any

__all__ = ["CAPTION_GID", "add_caption", "caption_runs", "code_version", "describe_run"]

CAPTION_GID = "muonlab-caption"
"""The ``gid`` of a caption's Text artist (how a later caption finds and replaces it)."""
MAX_CHARS = 220
"""A caption's longest line: past it, the runs are counted instead of named one by one."""


@functools.lru_cache(maxsize=1)
def code_version() -> str:
    """This process's muonlab: "muonlab <commit>" (with "+changes" where files differ from it) in a
    git checkout, else "muonlab <version>"."""
    from importlib.metadata import PackageNotFoundError, version

    from ..runs import _git

    git = _git(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if git and git.get("commit"):
        return f"muonlab {git['commit'][:8]}" + ("+changes" if git.get("changed") else "")
    try:
        return f"muonlab {version('muonlab')}"
    except PackageNotFoundError:
        return "muonlab (version unknown)"


def _commit_of(provenance: Mapping | None) -> str | None:
    git = (provenance or {}).get("git") or {}
    if git.get("commit"):
        return git["commit"][:8] + ("+changes" if git.get("changed") else "")
    return (provenance or {}).get("muonlab")


def _optimizer_of(config: Mapping) -> str | None:
    described = config.get("optimizer")
    if isinstance(described, Mapping) and described.get("type"):
        return str(described["type"]).rsplit(".", 1)[-1]
    for key in ("train", "train_model", "train_worker"):
        args = config.get(key)
        if isinstance(args, Mapping) and args.get("optimizer"):
            return str(args["optimizer"])
    return None


def describe_run(run: Any) -> str | None:
    """What produced ``run``, in a few words, or None where nothing is known of it (a list of
    losses). A loaded record (``muonlab.runs.load``): "record NAME (KIND, OPTIMIZER, N steps,
    seed S, commit C)"; a live History or Comparison: its record's folder name, "not saved" if none."""
    from ..runs import RunRecord

    if isinstance(run, RunRecord):
        history = run.history
        steps = len(history.steps) if history is not None and getattr(history, "steps", None) else None
        if steps is None and run.comparison is not None:
            steps = getattr(run.comparison, "steps", None)
        seeds = sorted({v for v in (run.seeds or {}).values() if isinstance(v, int)})
        commit = _commit_of(run.provenance)
        bits = [run.kind, _optimizer_of(run.config or {}),
                f"{steps} steps" if steps else None,
                ("seed " if len(seeds) == 1 else "seeds ") + ",".join(map(str, seeds)) if seeds else None,
                f"commit {commit}" if commit else None]
        return f"record {run.name} (" + ", ".join(b for b in bits if b) + ")"
    record = getattr(run, "record", None)
    if isinstance(record, str):
        return f"record {os.path.basename(os.path.normpath(record))}"
    if hasattr(run, "train_loss") or hasattr(run, "configs"):  # a History or a Comparison, not saved
        return "not saved"
    return None


def caption_runs(runs: Any) -> str:
    """The caption of a plot of ``runs`` (a mapping name -> run, or one run): each run's
    ``describe_run``, then the code plotting them where any run is live (no record loaded)."""
    from ..runs import RunRecord

    items = list(runs.items()) if isinstance(runs, Mapping) else [(None, runs)]
    parts, live = [], False
    for name, run in items:
        text = describe_run(run)
        live = live or not isinstance(run, RunRecord)
        if text is not None:
            parts.append(f"{name}: {text}" if name is not None else text)
    line = "; ".join(parts)
    if len(line) > MAX_CHARS:
        line = f"{len(parts)} runs"
    if live:
        line = f"{line}; plotted by {code_version()}" if line else f"plotted by {code_version()}"
    return line


def add_caption(fig, text: str) -> None:
    """Put ``text`` at the bottom left of ``fig`` in small grey type, replacing the caption a
    previous plot left there (a panel redraws into the same figure)."""
    for old in [t for t in fig.texts if t.get_gid() == CAPTION_GID]:
        old.remove()
    if text:
        fig.text(0.005, 0.005, text, fontsize=6.5, color="0.35", ha="left", va="bottom", gid=CAPTION_GID)
