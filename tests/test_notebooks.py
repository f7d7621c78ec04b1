"""The committed notebooks store exactly what strict nbval compares, and nothing else.

`make test` runs `pytest --nbval --nbval-sanitize-with notebooks/nbval_sanitize.cfg notebooks`:
every code cell not marked `# NBVAL_IGNORE_OUTPUT` / `# NBVAL_SKIP` is compared with its stored
output, but only if it stores an execution count (nbval passes an "unrun" cell without looking).
`notebooks/_store_outputs.py` writes notebooks this way; these checks catch a notebook edited or
autosaved by JupyterLab since (raw timings, figures, widget state, ignored cells with outputs).
"""

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.test_notebooks_at_default_size import SIZES_BY_CI

NOTEBOOK_DIR = Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
_spec = importlib.util.spec_from_file_location("_store_outputs", NOTEBOOK_DIR / "_store_outputs.py")
store_outputs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(store_outputs)
FIX = "run `CI=1 .venv/bin/python notebooks/_store_outputs.py`"


def _code_cells(path):
    cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]
    return [(i, "".join(c["source"]).strip().splitlines()[0][:60], c) for i, c in enumerate(cells)]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_ignored_cells_store_nothing(path):
    for i, first, cell in _code_cells(path):
        if not store_outputs.is_compared(cell):
            assert not cell["outputs"] and cell["execution_count"] is None, (
                f"{path.name} code cell {i} ({first!r}) is not compared but stores outputs or an execution "
                f"count (a JupyterLab autosave?): {FIX}")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_compared_cells_store_their_ci_run(path):
    last = 0
    for i, first, cell in _code_cells(path):
        if not store_outputs.is_compared(cell):
            continue
        where = f"{path.name} code cell {i} ({first!r})"
        count = cell["execution_count"]
        assert count is not None, f"{where} stores no execution count, so nbval would compare nothing: {FIX}"
        assert count > last, f"{where}: execution counts must rise through the notebook, as in one run: {FIX}"
        last = count
        for o in cell["outputs"]:
            assert o["output_type"] != "error" or store_outputs.raises(cell), f"{where} stores an error"
            extra = set(o.get("data", {})) - set(store_outputs.TEXT_MIMES)
            assert not extra, f"{where} stores {sorted(extra)}: mark it # NBVAL_IGNORE_OUTPUT"
        text = store_outputs.output_text(cell["outputs"])
        assert store_outputs.sanitize(text) == text, (
            f"{where} stores unsanitized output (a run saved by JupyterLab?): {FIX}")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_check_cells_store_a_passing_check(path):
    checks = [(i, first, c) for i, first, c in _code_cells(path) if store_outputs.is_check(c)]
    for i, first, cell in checks:
        where = f"{path.name} code cell {i} ({first!r})"
        assert store_outputs.is_compared(cell), f"{where} is a check nbval would not compare"
        text = store_outputs.output_text(cell["outputs"])
        assert text.strip(), f"{where}: a check cell must print what it checked: {FIX}"
        for word in ("FAIL", "False", "Traceback"):
            assert word not in text, f"{where} stores a failing check: {text[:200]!r}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_no_widget_state_stored(path):
    assert "widgets" not in json.loads(path.read_text())["metadata"], (
        f"{path.name} stores widget state (JupyterLab's 'save widget state'): {FIX}")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_ci_is_read_once_in_the_first_cell_or_the_notebook_says_it_has_one_size(path):
    """Sized by CI: ``SMOKE`` in the first code cell, the only place that reads ``CI``; or one size,
    said in the first markdown (tests/test_notebooks_at_default_size.py then has nothing to rerun)."""
    cells = json.loads(path.read_text())["cells"]
    code = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
    if SIZES_BY_CI in code[0]:
        assert not any('"CI"' in src for src in code[1:]), path.name
    else:
        assert not any('"CI"' in src or "SMOKE" in src for src in code), path.name
        intro = "".join(next(c for c in cells if c["cell_type"] == "markdown")["source"])
        assert "runs at one size" in intro, path.name


# What changes between runs becomes a fixed word; the facts around it stay.
SANITIZED = [
    ("muon   final val loss 4.419   optimizer step 105.9 ms", "muon   final val loss 4.419   optimizer step <time>"),
    ("took 84 s, then 1.5e-03 s and 2 min", "took <time>, then <time> and <time>"),
    ("12,345.6 us; 7 ns; 3 seconds", "<time>; <time>; <time>"),
    ("1,234 tokens/s at 310.2 TFLOP/s, 12 it/s", "<rate> at <rate>, <rate>"),
    ("[00:03<00:01, 2.50it/s] 0:00:01.25", "[<duration><<duration>, <rate>] <duration>"),
    ("<Span object at 0x7f3a2c1d9e80>", "<Span object at 0x<addr>>"),
    ("worker pid 4242 (PID: 77) process 12 worker_pid=9", "worker pid <pid> (PID: <pid>) process <pid> worker_pid=<pid>"),
    ("port=29500, MASTER_PORT=29501 tcp://127.0.0.1:29502 localhost:8888",
     "port=<port>, MASTER_PORT=<port> tcp://127.0.0.1:<port> localhost:<port>"),
    ("saved to /tmp/muonlab_nb05_k2j3/step and /var/folders/x1/T/a.bin.", "saved to <tmp> and <tmp>"),
    ("at 2026-11-22 21:58:56,123 and 2026-11-22T21:58:56Z on Sun Nov 22 21:58:56 2026", "at <date> and <date> on <date>"),
    ("[W1122 21:58:56.680148370 ProcessGroupGloo.cpp:512] Warning", "[<log-time> ProcessGroupGloo.cpp:512] Warning"),
    # kernel error magnitudes move with the CPU (the OK/FAIL against a tolerance is the fact)
    ("sym_matmul 127x300 float16        max abs err 4.85e-04", "sym_matmul 127x300 float16        max abs err <error>"),
]
UNCHANGED = [
    "FSDP2, 4 ranks: mean loss over ranks 5.726 -> 5.570 in 2 steps",
    "lr=0.02 mu=0.95 ns=5 keller",
    "  0 all_to_all (256, 64)        2     4       32768       0.0236  blocks.0.mlp.fc.weight",
    "8 experts on mesh (4, 2): rebalance w_in; max-rank NS GFLOP 601",
    "dense     64  xtuner                  64.000      2.495        29.97",
    "resumed at step 3; rank 1 of 2 failed; 1,024 x 4,096 symmetric 13,958,643,712",
]


@pytest.mark.parametrize("raw, expected", SANITIZED)
def test_sanitize_replaces_what_varies(raw, expected):
    assert store_outputs.sanitize(raw) == expected
    assert store_outputs.sanitize(expected) == expected, "stored outputs are sanitized again by nbval"


@pytest.mark.parametrize("text", UNCHANGED)
def test_sanitize_keeps_facts(text):
    assert store_outputs.sanitize(text) == text


def test_stored_outputs_pass_strict_nbval_and_a_changed_one_fails(tmp_path, monkeypatch):
    """The store script and strict nbval agree on a small notebook; a stored output edited fails."""
    import nbformat

    cells = ['import os, time\nSMOKE = "CI" in os.environ',
             'print(f"took {1e3 * time.perf_counter():.1f} ms in pid {os.getpid()}")',
             '# NBVAL_IGNORE_OUTPUT\nprint(time.time())',
             '# NBVAL_CHECK_OUTPUT\nprint("adds up:", 2 + 2 == 4)',
             '1 + 1;']  # nbval runs cells without history, so the ';' does not silence the 2
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    good = tmp_path / "good.ipynb"
    nbformat.write(nb, good)
    monkeypatch.setenv("CI", "1")
    assert store_outputs.store(good) == (4, 1)

    stored = [c for c in nbformat.read(good, as_version=4).cells]
    assert store_outputs.output_text(stored[1].outputs) == "took <time> in pid <pid>\n"
    assert not stored[2].outputs and stored[2].execution_count is None
    assert [o.output_type for o in stored[4].outputs] == ["execute_result"]
    stored[1].outputs[0].text = "took <time> in process <pid>\n"
    bad = tmp_path / "bad.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=stored, metadata=nb.metadata), bad)

    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "--color=no", "--rootdir", str(tmp_path), "--nbval",
         "--nbval-sanitize-with", str(store_outputs.SANITIZE_FILE), good.name, bad.name],
        cwd=tmp_path, capture_output=True, text=True, timeout=300)
    results = {f"{m[1]} {m[2]}": m[3] for m in re.finditer(r"^(good|bad)\W+ipynb::Cell (\d+) (PASSED|FAILED)",
                                                         run.stdout, flags=re.MULTILINE)}
    assert results == {**{f"good {i}": "PASSED" for i in range(5)}, **{f"bad {i}": "PASSED" for i in (0, 2, 3, 4)},
                       "bad 1": "FAILED"}, run.stdout[-3000:]
