"""Tables and results files for the benchmark scripts.

Every bench_*.py prints its tables and writes benchmarks/results/NAME.md headed by the command that
reruns it and the machine it ran on. That part is the same for all of them, so it lives here: the
results files keep one layout, and a change to it is made once.

    from _report import md_table, results_path, text_table, write_report

    print(text_table(header, rows))
    write_report(results_path("planner"), "Planner scenarios", md_table(header, rows), script=__file__)
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

from _machine import machine

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = RESULTS.parent.parent


def results_path(name: str) -> Path:
    """benchmarks/results/NAME.md, where a script's measured numbers are kept."""
    return RESULTS / f"{name}.md"


def md_table(header, rows) -> str:
    """A markdown table; cells go through str()."""
    lines = ["| " + " | ".join(map(str, header)) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(map(str, row)) + " |" for row in rows]
    return "\n".join(lines)


def text_table(header, rows) -> str:
    """The same table with aligned columns, for the terminal."""
    cells = [[str(c) for c in row] for row in [header, *rows]]
    widths = [max(len(c) for c in col) for col in zip(*cells)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in cells)


def command(script: str | Path, argv=None) -> str:
    """The command line that reruns this benchmark from the repository root.

    ``argv`` is what ``main(argv)`` was given (None: the process's own arguments); PYTHONPATH is
    included when set because the scripts may need it to import muonlab from a checkout.
    """
    args = sys.argv[1:] if argv is None else list(argv)
    path = Path(script).resolve()
    if path.is_relative_to(ROOT):
        path = path.relative_to(ROOT)
    env = f"PYTHONPATH={os.environ['PYTHONPATH']} " if os.environ.get("PYTHONPATH") else ""
    return env + " ".join(shlex.quote(str(a)) for a in ["python", path, *args])


def write_report(out: str | Path, title: str, body: str, *, script: str | Path, argv=None,
                 machine_note: str = "") -> str:
    """Write ``out``: the title, the command, the machine (plus ``machine_note``), then ``body``.

    ``machine_note`` continues the machine paragraph: what the script knows about the conditions
    of the run (load, ranks, GPU). Returns the text written.
    """
    machine_line = f"Machine: {machine()}." + (f" {machine_note.strip()}" if machine_note.strip() else "")
    body = body.strip("\n")
    text = f"# {title}\n\nCommand (repository root): `{command(script, argv)}`\n\n{machine_line}\n\n{body}\n"
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"wrote {out}")
    return text
