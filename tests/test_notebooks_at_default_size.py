"""Every notebook that sizes its runs by ``CI``, at its default size as a researcher runs it (``CI``
unset), under ``--nbval-lax``.

Strict nbval (``make test``) runs the notebooks at the smoke size ``CI`` selects and compares every
stored output; here each runs at its default size and only its ``# NBVAL_CHECK_OUTPUT`` cells are
compared, so a run that breaks only after some steps fails here.

Each notebook runs in a pytest process of its own, since its kernel must not see ``CI``, on a copy
of the notebook in a temporary folder: a notebook writes its run folders and checkpoints beside
itself (``runs/``), and the strict run of the same notebook may be running at the same moment on
another xdist worker. One class per notebook: ``--dist loadscope`` keeps a module's tests on one
worker but spreads classes, so the notebooks run side by side with the rest of the suite.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

NOTEBOOK_DIR = Path(__file__).resolve().parent.parent / "notebooks"
SIZES_BY_CI = 'SMOKE = "CI" in os.environ'
"""A notebook whose first code cell reads this sizes its runs by ``CI``; one that doesn't runs at one
size, and its strict run is its run at default size."""
SAME_SIZE_WITHOUT_CUDA = {"04_kernels": "CI picks only the shapes of its GPU benchmark"}
"""Notebooks that read ``CI`` but run the same cells at both sizes where there is no GPU."""


def sizes_by_ci(notebook: Path) -> bool:
    first = next(c for c in json.loads(notebook.read_text())["cells"] if c["cell_type"] == "code")
    return SIZES_BY_CI in "".join(first["source"])


NOTEBOOKS = sorted(nb for nb in NOTEBOOK_DIR.glob("[0-9]*.ipynb") if sizes_by_ci(nb))
CELL_TIMEOUT_S = 900
"""Per cell, as long as the longest default-size cell may take on a loaded 2-core machine."""


def run_at_default_size(notebook: Path, tmp_path: Path) -> None:
    copy = tmp_path / notebook.name
    shutil.copy(notebook, copy)
    # no CI, and none of the suite's MUONLAB_ settings (run folders, warm workers): a researcher's
    env = {k: v for k, v in os.environ.items() if k != "CI" and not k.startswith("MUONLAB_")}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--color=no", "--rootdir", str(tmp_path),
         "-o", f"timeout={CELL_TIMEOUT_S}", "--nbval-lax", copy.name],
        cwd=tmp_path, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, (f"{notebook.name} at its default size (CI unset) failed under --nbval-lax "
                                  f"(rc {proc.returncode}):\n{proc.stdout[-8000:]}\n{proc.stderr[-3000:]}")


def _notebook_class(notebook: Path) -> type:
    @pytest.mark.timeout(CELL_TIMEOUT_S * 3)
    def test_runs_and_its_checks_hold(self, tmp_path):
        if notebook.stem in SAME_SIZE_WITHOUT_CUDA and not torch.cuda.is_available():
            pytest.skip(f"{notebook.name}: without CUDA its default size is its CI size "
                        f"({SAME_SIZE_WITHOUT_CUDA[notebook.stem]}): the strict run ran it")
        run_at_default_size(notebook, tmp_path)

    name = "TestAtDefaultSize_" + notebook.stem
    return type(name, (), {"test_runs_and_its_checks_hold": test_runs_and_its_checks_hold, "__qualname__": name})


for _nb in NOTEBOOKS:
    _cls = _notebook_class(_nb)
    globals()[_cls.__name__] = _cls
