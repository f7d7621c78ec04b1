"""The floors of muonlab's house, and that imports point only down them.

Read from what the code does, bottom up:

0. ``_base`` (dist_on, rank_or_zero, local_shard, check_whole, collective_device, ...), ``files``,
   ``processes``, ``bars``, ``stats``: helpers that import nothing from muonlab.
1. ``kernels``: Newton-Schulz on tensors.
2. ``models``, ``trace``, ``data``: a model, the spans and recorders a step writes into, the corpus.
3. ``comm``: specs, the planner, the paths, the engine (which records into ``trace``), the cost model
   and the plan against the run.
4. ``optim``: Muon, calling the engine; it knows models' attention layers for QK-clip and heads.
5. ``distributed``: parallelism applied to models (FSDP2, DDP, EP), which reads the optimizer's
   head rules to keep heads whole; the device rule.
6. ``launcher``, ``checkpoint``, ``simulate``, ``calibration``: worker processes (on the device
   rule), checkpoints of a model and its optimizer, plans at any world size, a hardware profile
   measured by running Muon steps.
7. ``runs``: run records (what is written; loading and rerunning reach up, see ``LATE_IMPORTS``).
8. ``train``: the one-process loop, writing records.
9. ``experiments``, ``run_checks``: worker entry points and the comparison, checks of a history.
10. ``viz``: figures and panels, which run trainings and comparisons.
11. ``demo``: ``make demo``, training and launching, then its figures.
12. ``cli``.

The package root (``muonlab/__init__.py``, the public surface) may import any floor. A module may
import its own package, any lower floor, and nothing on its own floor's other packages or above.
An import inside a function counts too: one that reaches up is allowed only where ``LATE_IMPORTS``
names it with its reason.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "muonlab"

FLOORS = [
    {"_base", "files", "processes", "bars", "stats"},
    {"kernels"},
    {"models", "trace", "data"},
    {"comm"},
    {"optim"},
    {"distributed"},
    {"launcher", "checkpoint", "simulate", "calibration"},
    {"runs"},
    {"train"},
    {"experiments", "run_checks"},
    {"viz"},
    {"demo"},
    {"cli"},
]
FLOOR = {unit: level for level, units in enumerate(FLOORS) for unit in units}

# (importing module, imported unit): imports inside functions that reach up on purpose.
LATE_IMPORTS = {
    # A record is written by train (below) and reruns what wrote it: loading builds a History,
    # rerunning calls train, compare, train_model, train_worker and launch.
    ("muonlab.runs", "train"): "a loaded record's History; rerunning a train record",
    ("muonlab.runs", "experiments"): "rerunning a comparison or a launched run",
    ("muonlab.runs", "launcher"): "rerunning a launched run",
}


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def unit_of(module: str) -> str | None:
    """The floor unit of a muonlab module: its top-level package or module under muonlab."""
    parts = module.split(".")
    return parts[1] if parts[0] == "muonlab" and len(parts) > 1 else None


def imports_of(path: Path, root: Path = ROOT) -> list[tuple[str, int, bool]]:
    """(imported muonlab module, line, inside a function) for every import in ``path``."""
    module = module_name(path, root)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                found.extend((a.name, child.lineno, in_function) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package.split(".")[: len(package.split(".")) - (child.level - 1)]
                    target = ".".join(base + ([child.module] if child.module else []))
                else:
                    target = child.module or ""
                if target == "muonlab":  # `from .. import runs`: the names are the modules
                    found.extend((f"muonlab.{a.name}", child.lineno, in_function) for a in child.names)
                else:
                    found.append((target, child.lineno, in_function))
            visit(child, inner)

    visit(tree, False)
    return [(target, line, late) for target, line, late in found if target.startswith("muonlab")]


def violations(root: Path = ROOT) -> list[str]:
    out = []
    for path in sorted(root.rglob("*.py")):
        module = module_name(path, root)
        unit = unit_of(module)
        if unit is None:  # the package root: the public surface imports every floor
            continue
        assert unit in FLOOR, f"{module} is on no floor: add {unit!r} to FLOORS in {__file__}"
        for target, line, late in imports_of(path, root):
            other = unit_of(target)
            if other is None or other == unit:
                continue
            assert other in FLOOR, f"{target} (imported by {module}) is on no floor"
            if FLOOR[other] < FLOOR[unit]:
                continue
            if late and (module, other) in LATE_IMPORTS:
                continue
            where = "inside a function" if late else "at module level"
            out.append(f"{path.relative_to(root.parent)}:{line}: {unit} (floor {FLOOR[unit]}) imports "
                       f"{target} (floor {FLOOR[other]}) {where}")
    return out


def test_imports_point_only_down_the_floors():
    found = violations()
    assert not found, "imports that run up the house:\n" + "\n".join(found)


def test_the_ground_floor_imports_nothing_from_muonlab():
    for unit in FLOORS[0]:
        path = ROOT / f"{unit}.py"
        assert path.exists(), path
        assert imports_of(path) == [], unit


def test_every_late_import_allowed_is_still_there():
    # an entry whose import went away would otherwise stay, allowing it back unnoticed
    seen = set()
    for path in ROOT.rglob("*.py"):
        module = module_name(path)
        seen.update((module, unit_of(target)) for target, _, late in imports_of(path) if late)
    assert set(LATE_IMPORTS) <= seen, set(LATE_IMPORTS) - seen


def test_an_import_running_up_is_found(tmp_path):
    # the check itself: a model importing the optimizer (as models/gpt.py once did) is reported
    package = tmp_path / "muonlab"
    (package / "models").mkdir(parents=True)
    (package / "optim").mkdir()
    (package / "__init__.py").write_text("")
    (package / "models" / "__init__.py").write_text("")
    (package / "models" / "gpt.py").write_text("from ..optim.validation import check_whole\n")
    (package / "optim" / "__init__.py").write_text("from ..models import gpt\n")
    found = violations(package)
    assert found == ["muonlab/models/gpt.py:1: models (floor 2) imports muonlab.optim.validation (floor 4) at module level"]
