"""The committed notebooks: what nbval will compare, and nothing else stored.

nbval (`--nbval-lax`) compares a `# NBVAL_CHECK_OUTPUT` cell only when the notebook stores its
output and execution count; stored without them, the check silently passes whatever the cell
prints. Every other cell must be stored clean, so JupyterLab's autosave of a run (figures, timings,
pids) never lands in a commit. `notebooks/_store_checked_outputs.py` writes notebooks this way.
"""

import json
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
MARK = "# NBVAL_CHECK_OUTPUT"


def _code_cells(path):
    return [(i, c) for i, c in enumerate(json.loads(path.read_text())["cells"]) if c["cell_type"] == "code"]


def _text(outputs) -> str:
    parts = []
    for o in outputs:
        parts.append("".join(o.get("text", "")) + "".join(o.get("data", {}).get("text/plain", "")))
    return "".join(parts)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_checked_cells_store_what_nbval_compares(path):
    checked = [(i, c) for i, c in _code_cells(path) if MARK in "".join(c["source"])]
    for i, cell in checked:
        assert cell.get("execution_count") is not None and cell.get("outputs"), (
            f"{path.name} cell {i} is marked {MARK} but stores no output: nbval would compare nothing "
            "(run notebooks/_store_checked_outputs.py)")
        text = _text(cell["outputs"])
        assert text.strip(), f"{path.name} cell {i}: the stored output has no text to compare"
        assert not any(o.get("output_type") == "error" for o in cell["outputs"]), f"{path.name} cell {i}"
        for word in ("FAIL", "False", "Traceback"):
            assert word not in text, f"{path.name} cell {i} stores a failing check: {text[:200]!r}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_unchecked_cells_are_stored_clean(path):
    for i, cell in _code_cells(path):
        if MARK in "".join(cell["source"]):
            continue
        assert not cell.get("outputs") and cell.get("execution_count") is None, (
            f"{path.name} cell {i} stores outputs nbval never compares (strip them)")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_first_cell_sets_smoke_from_ci(path):
    (_, first), *_ = _code_cells(path)
    assert 'SMOKE = "CI" in os.environ' in "".join(first["source"]), path.name
