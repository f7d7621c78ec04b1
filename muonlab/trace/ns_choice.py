"""What Newton-Schulz ran, in words: the labels the figures and tables put on a run or a step.

All three read ``Muon.resolved_choices()`` (one dict per plan batch: its dtype, form, backend):
``ns_choice_label`` is the long line of a timeline title, per group of batches;
``ns_choice_short`` fits a legend; ``ns_choice_summary`` counts forms for a comparison's table.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = ["ns_choice_label", "ns_choice_short", "ns_choice_summary"]

_SHORT = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float64": "fp64"}


def ns_choice_short(choices: Sequence[Mapping] | None) -> str:
    """What Newton-Schulz ran, short enough for a legend: "bf16, plain, torch" from
    ``Muon.resolved_choices()`` (one dict per plan batch); where batches differ, each field lists
    its values in order ("bf16, gram/plain, torch"); "" for no choices (not muonlab's Muon)."""
    if not choices:
        return ""
    fields = []
    for key in ("dtype", "form", "backend"):
        # "auto (timed at the first step)" -> "auto", "bfloat16" -> "bf16"
        values = dict.fromkeys(_SHORT.get(v, v) for v in (str(c.get(key, "?")).split(" (")[0] for c in choices))
        fields.append("/".join(values))
    return ", ".join(fields)


def ns_choice_label(choices) -> str:
    """One line naming the Newton-Schulz form, dtype and backend that ran, per group of batches:
    ``choices`` is ``Muon.resolved_choices()`` (a dict per plan batch). E.g. "Newton-Schulz: gram
    form, bf16, torch (batches 0-2); plain form, bf16, torch (batch 3)"."""
    groups: dict[tuple, list[int]] = {}
    for i, c in enumerate(choices):
        groups.setdefault((c["form"], c["dtype"], c["backend"]), []).append(c.get("batch", i))
    if not groups:
        return "Newton-Schulz: no Muon batch"
    if len(groups) == 1:
        (form, dtype, backend), = groups
        return f"Newton-Schulz: {form} form, {dtype}, {backend} (every batch)"
    parts = []
    for (form, dtype, backend), batches in groups.items():
        which = f"batch {batches[0]}" if len(batches) == 1 else f"batches {_ranges(batches)}"
        parts.append(f"{form} form, {dtype}, {backend} ({which})")
    return "Newton-Schulz: " + "; ".join(parts)


def _ranges(numbers: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    out, run = [], [numbers[0]]
    for n in numbers[1:]:
        if n == run[-1] + 1:
            run.append(n)
        else:
            out.append(run)
            run = [n]
    out.append(run)
    return ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in out)


def ns_choice_summary(choices: Sequence[Mapping]) -> str:
    """What Newton-Schulz ran, in a few words: "gram x3 + plain x1, float32, torch"; forms counted
    by plan batch. "no Newton-Schulz" for an optimizer without it (AdamW)."""
    if not choices:
        return "no Newton-Schulz"
    forms: dict[str, int] = {}
    for c in choices:
        forms[c["form"]] = forms.get(c["form"], 0) + 1
    form = " + ".join(f"{f} x{n}" for f, n in forms.items()) if len(forms) > 1 else next(iter(forms))
    dtypes = "/".join(dict.fromkeys(str(c["dtype"]) for c in choices))
    backends = "/".join(dict.fromkeys(str(c["backend"]) for c in choices))
    return f"{form}, {dtypes}, {backends}"
