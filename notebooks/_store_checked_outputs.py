"""Run notebooks as CI does (CI=1, smoke sizes) and keep the outputs of `# NBVAL_CHECK_OUTPUT` cells.

nbval compares a checked cell only if the committed notebook stores that cell's output and
execution count; a checked cell stored without them is silently passed. Every other cell is kept
stripped (plots, widgets, timings are not compared). Run after changing what a checked cell prints:

    CI=1 .venv/bin/python notebooks/_store_checked_outputs.py notebooks/03_moe_and_planner.ipynb ...
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient

MARK = "# NBVAL_CHECK_OUTPUT"


def is_checked(cell) -> bool:
    return cell.cell_type == "code" and MARK in cell.source


def store(path: Path, timeout_s: int = 900) -> int:
    """Execute ``path`` in its folder; keep only checked cells' outputs. Returns their number."""
    nb = nbformat.read(path, as_version=4)
    executed = nbformat.read(path, as_version=4)
    NotebookClient(executed, timeout=timeout_s, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    checked = 0
    for cell, ran in zip(nb.cells, executed.cells):
        if cell.cell_type != "code":
            continue
        if is_checked(cell):
            cell.outputs, cell.execution_count = ran.outputs, ran.execution_count
            checked += 1
        else:
            cell.outputs, cell.execution_count = [], None
    nbformat.write(nb, path)
    return checked


def main(paths: list[str]) -> None:
    if "CI" not in os.environ:
        raise SystemExit("run with CI=1: the stored outputs must be the smoke-sized ones CI compares")
    for p in paths:
        print(f"{p}: stored the outputs of {store(Path(p))} checked cells")


if __name__ == "__main__":
    main(sys.argv[1:])
