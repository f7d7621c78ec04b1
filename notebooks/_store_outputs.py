"""Run notebooks as CI does (CI=1, smoke sizes) and store exactly the outputs strict nbval compares.

    CI=1 .venv/bin/python notebooks/_store_outputs.py                       # every notebook
    CI=1 .venv/bin/python notebooks/_store_outputs.py notebooks/01_quickstart.ipynb

The convention, checked by `pytest --nbval --nbval-sanitize-with notebooks/nbval_sanitize.cfg`:
- a code cell marked `# NBVAL_IGNORE_OUTPUT` (figures, widgets, progress bars) or `# NBVAL_SKIP`
  stores no output and no execution count;
- every other code cell stores its execution count and its output, sanitized: nbval compares it,
  so a cell stored with an empty output must keep printing nothing (a new warning fails it);
- `# NBVAL_CHECK_OUTPUT` marks cells whose output is a check: it must print and never FAIL/False.
Cells run as nbval runs them, so what is stored is what nbval sees: without history (a trailing
`;` does not silence a value) and without a frontend (output sent to an Output widget lands in the
cell). A compared cell that shows an image, a widget or an error is refused: mark it ignored.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbval.plugin import coalesce_streams, find_comment_markers, find_metadata_tags, get_sanitize_patterns

HERE = Path(__file__).resolve().parent
SANITIZE_FILE = HERE / "nbval_sanitize.cfg"
CHECK_MARK = "# NBVAL_CHECK_OUTPUT"
# The only output data a compared cell may carry; nbval never compares images or widget views,
# so a cell showing them would store bytes no test reads.
TEXT_MIMES = ("text/plain", "text/html", "text/markdown", "text/latex", "application/json")


def _markers(cell) -> dict:
    """nbval's own reading of a cell's markers (comments win over tags, as in nbval)."""
    found = dict(find_metadata_tags(cell.get("metadata", {})))
    found.update(find_comment_markers("".join(cell.get("source", ""))))
    return found


def is_compared(cell) -> bool:
    """True for a code cell strict nbval compares: neither ignored nor skipped."""
    markers = _markers(cell)
    return cell["cell_type"] == "code" and markers.get("check", True) and not markers.get("skip", False)


def raises(cell) -> bool:
    return bool(_markers(cell).get("check_exception", False))


def is_check(cell) -> bool:
    return cell["cell_type"] == "code" and CHECK_MARK in "".join(cell.get("source", ""))


def sanitize(text: str, patterns=None) -> str:
    """The text as nbval compares it: every replacement of nbval_sanitize.cfg, in order."""
    if patterns is None:
        patterns = get_sanitize_patterns(SANITIZE_FILE.read_text())
    for regex, replace in patterns:
        text = re.sub(regex, replace, text)
    return text


def output_text(outputs) -> str:
    """All text of stored outputs: streams and text data, joined."""
    parts = []
    for o in outputs:
        parts.append("".join(o.get("text", "")))
        for mime, value in o.get("data", {}).items():
            if mime.startswith("text/"):
                parts.append("".join(value))
    return "".join(parts)


class _RunAsNbval(NotebookClient):
    """nbclient driven the way nbval drives a kernel, so the outputs match what it compares."""

    def __init__(self, nb, **kw):
        super().__init__(nb, store_widget_state=False, record_timing=False, **kw)
        self.comm_open_handlers = {}  # no Output-widget capture: nbval has no frontend either

    async def async_execute_cell(self, cell, cell_index, execution_count=None, store_history=True):
        return await super().async_execute_cell(cell, cell_index, execution_count, store_history=False)

    def clear_output(self, outs, msg, cell_index):
        pass  # nbval keeps what was printed before a clear_output


def _kept_outputs(path: Path, index: int, cell, outputs, patterns) -> list:
    """A compared cell's outputs as stored: coalesced, sanitized, text only; refuses the rest."""
    kept = []
    for o in coalesce_streams([nbformat.from_dict(o) for o in outputs]):
        kind = o["output_type"]
        if kind == "stream":
            kept.append(nbformat.v4.new_output("stream", name=o["name"], text=sanitize(o["text"], patterns)))
        elif kind in ("display_data", "execute_result"):
            other = sorted(set(o["data"]) - set(TEXT_MIMES))
            if other:
                raise ValueError(f"{_where(path, index, cell)} shows {other}, which nbval does not compare: mark the cell "
                                 "# NBVAL_IGNORE_OUTPUT or stop it from displaying them")
            data = {mime: sanitize("".join(v), patterns) if isinstance(v, (str, list)) else v
                    for mime, v in o["data"].items()}
            if kind == "execute_result":
                kept.append(nbformat.v4.new_output(kind, data=data, execution_count=o["execution_count"]))
            else:
                kept.append(nbformat.v4.new_output(kind, data=data))
        else:  # an error the cell is marked to raise: nbval compares its name and value
            kept.append(o)
    return kept


def _where(path: Path, index: int, cell) -> str:
    lines = "".join(cell.get("source", "")).strip().splitlines()
    return f"{path.name} code cell {index} ({lines[0] if lines else ''!r})"


def store(path: Path, timeout_s: int = 900) -> tuple[int, int]:
    """Execute ``path`` in its folder and store the outputs of its compared cells.

    Returns (compared cells, ignored cells).
    """
    patterns = get_sanitize_patterns(SANITIZE_FILE.read_text())
    nb = nbformat.read(path, as_version=4)
    executed = nbformat.read(path, as_version=4)
    _RunAsNbval(executed, timeout=timeout_s, kernel_name=nb.metadata.get("kernelspec", {}).get("name", "python3"),
                allow_errors=True, resources={"metadata": {"path": str(path.parent)}}).execute()
    compared = ignored = 0
    index = 0
    for cell, ran in zip(nb.cells, executed.cells):
        if cell.cell_type != "code":
            continue
        cell.metadata.pop("execution", None)
        for o in ran.outputs:
            if o["output_type"] == "error" and not raises(cell):
                raise RuntimeError(f"{_where(path, index, cell)} raised {o['ename']}: {o['evalue']}")
        if is_compared(cell):
            cell.outputs = _kept_outputs(path, index, cell, ran.outputs, patterns)
            cell.execution_count = ran.execution_count
            compared += 1
        else:
            cell.outputs, cell.execution_count = [], None
            ignored += 1
        index += 1
    nb.metadata.pop("widgets", None)
    nbformat.write(nb, path)
    return compared, ignored


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", type=Path, help="default: every notebooks/*.ipynb")
    args = parser.parse_args(argv)
    if "CI" not in os.environ:
        raise SystemExit("run with CI=1: the stored outputs must be the smoke-sized ones CI compares")
    for path in args.notebooks or sorted(HERE.glob("*.ipynb")):
        compared, ignored = store(path)
        print(f"{path}: stored the outputs of {compared} compared cells; {ignored} ignored cells stored clean")


if __name__ == "__main__":
    sys.exit(main())
