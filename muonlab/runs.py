"""Run records: what a run was (configuration, seeds, code and machine) and what it measured, kept
under ``runs/<name>/`` ($MUONLAB_RUNS_DIR or ./runs, where launch keeps its run folders) so that a
later notebook can plot it beside a live run, compare against it, or run it again.

    hist = muonlab.train(model, opt, steps=100, loss_fn="cross_entropy", batches=(x, y), batch_size=64)
    hist.record                                  # the folder it wrote: runs/train-<date>
    muonlab.runs.list()                          # [(name, kind, created), ...], oldest first
    rec = muonlab.runs.load("train-20261129-170000")
    plot_loss_curves({"saved": rec, "now": hist})
    again = rec.rerun()                          # the same losses, bit for bit on the same CPU

``train``, ``muonlab.experiments.compare.compare`` and the launched ``train_model`` and
``train_worker`` (rank 0, into the launch's own folder) write one by default (``record=False``
does not, a string names it). A folder holds ``record.json`` (configuration, seeds, provenance, the
history's series, the plan table; floats written exactly), ``series.pt`` (tensor series: QK-clip's
max logits), ``initial.pt`` (the model before its first step, with train's optimizer, scheduler
and RNG state: what ``rerun`` starts from) and ``data.pt`` (a batch source that is a dataset of
tensors); the last two are left out above ``KEEP_MAX_BYTES`` (the record says so, and ``rerun``
then takes them as arguments).
"""

from __future__ import annotations

import builtins
import dataclasses
import datetime
import importlib
import io
import json
import math
import os
import platform
import shutil
import subprocess
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["KEEP_MAX_BYTES", "RunRecord", "export_tensorboard", "list", "load", "provenance", "rerun", "runs_dir",
           "save"]

# The launcher's variable (muonlab.launcher.RUNS_DIR_ENV), named here too: importing the
# launcher to read it would make every train() import torch.distributed's elastic agent.
RUNS_DIR_ENV = "MUONLAB_RUNS_DIR"
RECORD_FILE = "record.json"
INITIAL_FILE = "initial.pt"
DATA_FILE = "data.pt"
SERIES_FILE = "series.pt"
FORMAT = 1
KINDS = ("train", "train_model", "train_worker", "compare")
KEEP_MAX_BYTES = 256 * 2 ** 20
"""The most bytes of tensors ``initial.pt`` or ``data.pt`` keep: a larger model or dataset is
described in the record but not kept (a record per run must not fill a disk)."""


def runs_dir() -> str:
    """Where records go: ``$MUONLAB_RUNS_DIR``, else ``runs`` (relative to the working directory)."""
    return os.environ.get(RUNS_DIR_ENV) or "runs"


def check_record_arg(record) -> None:
    """``record`` as train/compare take it: True (a new folder), False (none) or a folder name."""
    if isinstance(record, bool):
        return
    if not isinstance(record, str) or not record.strip() or record.startswith(".") or "/" in record \
            or os.sep in record:
        raise ValueError(f"record must be True (a new folder under {runs_dir()!r}), False (no record) or a folder "
                         f"name (no path separator, not starting with '.'), got {record!r}")


# ---------------------------------------------------------------------------------- provenance


def _git(package_dir: str) -> dict | None:
    """The commit of the checkout that holds the package, and the package's files changed from it
    (None when it is not in a git checkout: an installed wheel)."""
    def git(*args):
        return subprocess.run(["git", "-C", package_dir, *args], capture_output=True, text=True, timeout=10)

    try:
        tracked = git("ls-files", "--error-unmatch", "__init__.py")
        if tracked.returncode:
            return None
        head = git("rev-parse", "HEAD").stdout.strip()
        changed = git("status", "--porcelain", "--untracked-files=no", "--", ".").stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        return None
    return dict(commit=head or None, changed=[line[3:] for line in changed])


def provenance(device: torch.device | str | None = None) -> dict:
    """The code and the machine a run ran on: muonlab's version and git commit (with its changed
    files), torch, CUDA, the device, the CPU (and whether it has native bf16 matmul), threads."""
    from importlib.metadata import PackageNotFoundError, version

    from .kernels.newton_schulz import cpu_has_native_bf16

    try:
        muonlab_version = version("muonlab")
    except PackageNotFoundError:
        muonlab_version = None
    device = torch.device(device) if device is not None else None
    cuda = device is not None and device.type == "cuda"
    return dict(
        muonlab=muonlab_version, git=_git(os.path.dirname(os.path.abspath(__file__))), torch=torch.__version__,
        cuda=torch.version.cuda, device=None if device is None else str(device),
        device_name=torch.cuda.get_device_name(device) if cuda else None,
        cpu=platform.processor() or platform.machine(), cpu_native_bf16=cpu_has_native_bf16(),
        threads=torch.get_num_threads(), python=platform.python_version(), host=platform.node())


def machine_of(prov: dict) -> str:
    """One line naming where a run's seconds were measured (device, CPU kind, threads)."""
    where = prov.get("device_name") or prov.get("device") or "?"
    bf16 = "native bf16" if prov.get("cpu_native_bf16") else "no native bf16"
    return f"{where} on {prov.get('host', '?')} ({prov.get('cpu', '?')}, {bf16}, {prov.get('threads', '?')} threads)"


# ---------------------------------------------------------------------------------- JSON values


def encode(value) -> Any:
    """``value`` as JSON: dtypes and tuples tagged so ``decode`` gives them back; anything else
    that JSON cannot hold as ``{"__repr__": ...}`` (described, not rebuilt)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.dtype):
        return {"__dtype__": str(value).removeprefix("torch.")}
    if isinstance(value, tuple):
        return {"__tuple__": [encode(v) for v in value]}
    if isinstance(value, builtins.list):
        return [encode(v) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: encode(v) for k, v in value.items()}
    if torch.is_tensor(value) and value.numel() == 1:
        return value.item()
    if isinstance(value, torch.device):
        return str(value)
    return {"__repr__": repr(value)}


def decode(value) -> Any:
    """The inverse of ``encode``; a ``__repr__`` stays a dict (``rebuildable`` finds it)."""
    if isinstance(value, builtins.list):
        return [decode(v) for v in value]
    if isinstance(value, dict):
        if set(value) == {"__dtype__"}:
            return getattr(torch, value["__dtype__"])
        if set(value) == {"__tuple__"}:
            return tuple(decode(v) for v in value["__tuple__"])
        return {k: decode(v) for k, v in value.items()}
    return value


def unbuilt(value, where: str = "") -> builtins.list[str]:
    """Where in ``value`` (decoded) something was only described (``{"__repr__": ...}``)."""
    if isinstance(value, dict):
        if set(value) == {"__repr__"}:
            return [where or "value"]
        return [w for k, v in value.items() for w in unbuilt(v, f"{where}.{k}" if where else k)]
    if isinstance(value, (builtins.list, tuple)):
        return [w for i, v in enumerate(value) for w in unbuilt(v, f"{where}[{i}]")]
    return []


def function_ref(fn) -> str | None:
    """"module:qualname" of a function a fresh process can import (None for a lambda, a closure
    or one defined in a notebook or script)."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if not module or not qualname or module == "__main__" or "<" in qualname:
        return None
    try:
        found = importlib.import_module(module)
        for part in qualname.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError):
        return None
    return f"{module}:{qualname}" if found is fn else None


def import_ref(ref: str):
    module, qualname = ref.split(":")
    found = importlib.import_module(module)
    for part in qualname.split("."):
        found = getattr(found, part)
    return found


def describe_loss(loss) -> Any:
    """A loss as a record keeps it: its torch.nn.functional name, "module:qualname", None (the
    model's own), or a description."""
    if loss is None or isinstance(loss, str):
        return loss
    import torch.nn.functional as F

    name = getattr(loss, "__name__", None)
    if name and getattr(F, name, None) is loss:
        return name
    ref = function_ref(loss)
    return {"function": ref} if ref else {"__repr__": repr(loss)}


def rebuild_loss(described):
    if isinstance(described, dict) and "function" in described:
        return import_ref(described["function"])
    return described


def tensor_bytes(values) -> int:
    return sum(t.numel() * t.element_size() for t in values if torch.is_tensor(t))


def describe_batches(source, *, batch_size=None) -> tuple[dict | None, Any]:
    """(what a record says of a batch source, the tensors to keep in data.pt or None)."""
    from .train import is_dataset

    if source is None:
        return None, None
    if is_dataset(source):
        shapes = [[*t.shape] for t in source]
        described = dict(kind="dataset", shapes=shapes, dtypes=[str(t.dtype) for t in source], batch_size=batch_size)
        if tensor_bytes(source) > KEEP_MAX_BYTES:
            return dict(described, kept=False, why=f"over KEEP_MAX_BYTES ({KEEP_MAX_BYTES} bytes)"), None
        return dict(described, kept=True), tuple(t.detach().cpu() for t in source)
    if callable(source):
        ref = function_ref(source)
        return (dict(kind="callable", function=ref) if ref else
                dict(kind="callable", kept=False, why=f"{source!r} is not importable: pass it to rerun")), None
    return dict(kind="iterable", type=type(source).__name__, kept=False, why="pass it to rerun"), None


def describe_model(model: torch.nn.Module) -> dict:
    cfg = getattr(model, "cfg", None)
    out = dict(type=f"{type(model).__module__}.{type(model).__qualname__}",
               parameters=sum(p.numel() for p in model.parameters()))
    if dataclasses.is_dataclass(cfg):
        out["config"] = encode(dataclasses.asdict(cfg))
    if len(repr(model)) <= 4000:
        out["repr"] = repr(model)
    return out


def describe_optimizer(opt: torch.optim.Optimizer) -> dict:
    hyper = [{k: encode(v) for k, v in g.items() if k != "params"} | {"num_params": len(g["params"])}
             for g in opt.param_groups]
    out = dict(type=f"{type(opt).__module__}.{type(opt).__qualname__}", defaults=encode(dict(opt.defaults)),
               groups=hyper)
    options = getattr(opt, "options", None)  # muonlab Muon's optimizer-wide options (ns_dtype, ...)
    if dataclasses.is_dataclass(options):
        out["options"] = {f.name: encode(getattr(options, f.name)) for f in dataclasses.fields(options)}
    return out


def snapshot(model, optimizer=None, scheduler=None) -> tuple[bytes | None, str]:
    """The model, optimizer and scheduler (pickled together, so the optimizer's parameters are the
    model's) and the RNG states, as ``initial.pt``'s bytes; (None, why) where it cannot be kept."""
    size = tensor_bytes([*model.parameters(), *model.buffers()])
    if optimizer is not None:
        size += tensor_bytes(v for s in optimizer.state.values() for v in s.values())
    if size > KEEP_MAX_BYTES:
        return None, f"the model and optimizer hold {size} bytes, over KEEP_MAX_BYTES ({KEEP_MAX_BYTES})"
    buf = io.BytesIO()
    rng = dict(cpu=torch.get_rng_state(), cuda=torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None)
    try:
        torch.save(dict(model=model, optimizer=optimizer, scheduler=scheduler, rng=rng), buf)
    except Exception as e:  # a hook or process group that does not pickle: the run goes on, unrerunnable
        return None, f"not picklable: {type(e).__name__}: {e}"
    return buf.getvalue(), ""


# ---------------------------------------------------------------------------------- the record


@dataclass
class RunRecord:
    """One kept run. ``history`` (a ``muonlab.train.History``) for train and train_model records,
    ``comparison`` (a ``Comparison``) for compare records; the plot functions take the record in
    place of either. ``files``: what is kept beside record.json (or still to be written)."""

    name: str
    kind: str
    config: dict
    """JSON values: the arguments that made the run (tagged dtypes and tuples; see ``encode``)."""
    seeds: dict
    provenance: dict
    created: str
    history: Any = None
    comparison: Any = None
    plan_table: str | None = None
    path: str | None = None
    """The folder it was saved to or loaded from."""
    files: dict = field(default_factory=dict, repr=False)
    """{"initial" | "data" | "series": bytes or tensors to write, or a file name once written}."""

    def rerun(self, **overrides):
        """Run it again from its configuration (see :func:`rerun`)."""
        return rerun(self, **overrides)

    def read(self, what: str):
        """The kept ``initial`` (dict), ``data`` (dict of tensor tuples) or ``series`` (dict), or None.
        ``initial`` is a pickle (the model's classes are imported to read it): read records you trust."""
        kept = self.files.get(what)
        if kept is None:
            return None
        if isinstance(kept, str):
            if self.path is None:
                return None
            return torch.load(os.path.join(self.path, kept), map_location="cpu", weights_only=what != "initial")
        if isinstance(kept, bytes):
            return torch.load(io.BytesIO(kept), map_location="cpu", weights_only=False)
        return kept


def _history_json(hist) -> dict:
    out = {k: getattr(hist, k) for k in ("steps", "train_loss", "val_steps", "val_loss", "step_time_s",
                                         "opt_time_s", "tokens_per_step", "qk_clipped", "qk_overshoot")}
    out["ns_choices"] = encode(hist.ns_choices)
    out["spectral"] = [encode(dataclasses.asdict(r)) for r in hist.spectral]
    return out


def _history_from(data: dict, series: dict | None):
    from .trace.spectral import SpectralRecord
    from .train import History

    values = {k: v for k, v in data.items() if k not in ("ns_choices", "spectral")}
    hist = History(**values, ns_choices=decode(data["ns_choices"]),
                   spectral=[SpectralRecord(**decode(r)) for r in data["spectral"]])
    hist.max_logit = builtins.list((series or {}).get("max_logit", []))
    return hist


def _comparison_json(result) -> dict:
    return dict(runs=[encode(dataclasses.asdict(r)) for c in result.configs.values() for r in c.runs],
                configs={name: encode(c.settings) for name, c in result.configs.items()},
                machines=result.machines, seeds=result.seeds, steps=result.steps, window=result.window,
                confidence=result.confidence)


def _comparison_from(data: dict, config: dict):
    from .experiments.compare import Run, summarize

    runs = [Run(**decode(r)) for r in data["runs"]]
    return summarize(runs, {name: decode(s) for name, s in data["configs"].items()}, seeds=data["seeds"],
                     steps=data["steps"], target=config.get("target"), window=data["window"],
                     confidence=data["confidence"], machines=data.get("machines"))


def new_record(kind: str, *, config: dict, seeds: dict, device=None, **fields) -> RunRecord:
    """A record of a run that just ended, not yet saved (its name is given at ``save``)."""
    assert kind in KINDS, kind
    return RunRecord(name="", kind=kind, config=config, seeds=seeds, provenance=provenance(device),
                     created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), **fields)


def launch_folder() -> str | None:
    """In a launched worker, its launch's run folder (``runs/<launch name>``, where the rank logs
    are); None outside a launch."""
    import sys

    progress = sys.modules.get("muonlab.launcher.progress")
    sink = getattr(progress, "_sink", None)  # the worker's progress file: <run folder>/rank<r>/progress.jsonl
    return os.path.dirname(os.path.dirname(os.path.abspath(sink.name))) if sink is not None else None


def claim_folder(kind: str, name: str | None, root: str | None = None) -> str:
    """``<root>/<name>``, or a new ``<root>/<kind>-<date>[-k]`` (made, so two runs never share one)."""
    root = runs_dir() if root is None else root
    os.makedirs(root, exist_ok=True)
    if name is not None:
        check_record_arg(name)
        folder = os.path.join(root, name)
        os.makedirs(folder, exist_ok=True)
        return folder
    base, k = f"{kind}-{time.strftime('%Y%m%d-%H%M%S')}", 1
    while True:
        folder = os.path.join(root, base if k == 1 else f"{base}-{k}")
        try:
            os.makedirs(folder)
            return folder
        except FileExistsError:
            k += 1


def save(record: RunRecord, path: str | None = None) -> str:
    """Write ``record`` to the folder ``path`` (default ``<runs_dir()>/<record.name>``, a new
    ``<kind>-<date>`` one for a record without a name); returns the folder. Files written before
    under the same folder's names are replaced."""
    if not isinstance(record, RunRecord):
        raise TypeError(f"record must be a RunRecord, got {type(record).__name__}")
    if path is None:
        path = claim_folder(record.kind, record.name or None)
    else:
        os.makedirs(path, exist_ok=True)
    files = {}
    for what, file in (("initial", INITIAL_FILE), ("data", DATA_FILE), ("series", SERIES_FILE)):
        kept = record.files.get(what)
        if kept is None:
            continue
        if isinstance(kept, bytes):
            with open(os.path.join(path, file), "wb") as f:
                f.write(kept)
        elif not isinstance(kept, str):
            torch.save(kept, os.path.join(path, file))
        elif record.path is not None and os.path.abspath(record.path) != os.path.abspath(path):
            shutil.copyfile(os.path.join(record.path, kept), os.path.join(path, file))  # loaded elsewhere
        files[what] = file
    record.name, record.path = os.path.basename(os.path.normpath(path)), path
    record.files = files
    data = dict(format=FORMAT, name=record.name, kind=record.kind, created=record.created, config=record.config,
                seeds=record.seeds, provenance=record.provenance, plan_table=record.plan_table, files=files,
                history=None if record.history is None else _history_json(record.history),
                comparison=None if record.comparison is None else _comparison_json(record.comparison))
    tmp = os.path.join(path, RECORD_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)  # floats as repr: they read back to the same bits
    os.replace(tmp, os.path.join(path, RECORD_FILE))  # a reader never sees half a record
    return path


def load(name: str, *, root: str | None = None) -> RunRecord:
    """The record ``name`` (a folder under ``runs_dir()``, or a path to one)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a record's folder name or path, got {name!r}")
    folder = name if os.sep in name or "/" in name else os.path.join(runs_dir() if root is None else root, name)
    file = os.path.join(folder, RECORD_FILE)
    if not os.path.exists(file):
        known = [n for n, *_ in list_records(root)]
        raise ValueError(f"no record {name!r}: {file} does not exist; records under "
                         f"{root or runs_dir()!r}: {known[-10:]}")
    with open(file) as f:
        data = json.load(f)
    if data.get("format") != FORMAT:
        raise ValueError(f"{file}: record format {data.get('format')!r}, this muonlab reads {FORMAT}")
    record = RunRecord(name=os.path.basename(os.path.normpath(folder)), kind=data["kind"], config=data["config"],
                       seeds=data["seeds"], provenance=data["provenance"], created=data["created"],
                       plan_table=data.get("plan_table"), path=folder, files=dict(data.get("files") or {}))
    if data.get("history") is not None:
        record.history = _history_from(data["history"], record.read("series"))
        record.history.record = folder
    if data.get("comparison") is not None:
        record.comparison = _comparison_from(data["comparison"], data["config"])
        record.comparison.record = folder
    return record


def list_records(root: str | None = None) -> builtins.list[tuple[str, str, str]]:
    """(name, kind, created) of every record under ``root`` (default ``runs_dir()``), oldest first."""
    root = runs_dir() if root is None else root
    out = []
    for entry in sorted(os.listdir(root)) if os.path.isdir(root) else []:
        file = os.path.join(root, entry, RECORD_FILE)
        if os.path.exists(file):
            try:
                with open(file) as f:
                    data = json.load(f)
                out.append((entry, data.get("kind", "?"), data.get("created", "")))
            except (OSError, ValueError):  # a record being written by another process, or damaged
                continue
    return sorted(out, key=lambda row: row[2])


list = list_records  # noqa: A001 (muonlab.runs.list(), as the research loop reads)


def as_history(value):
    """A record's History (a train or train_model record), else ``value`` unchanged."""
    if isinstance(value, RunRecord):
        if value.history is None:
            raise TypeError(f"record {value.name!r} is a {value.kind} record, with no single history: "
                            f"plot it with plot_comparison")
        return value.history
    return value


def as_comparison(value):
    if isinstance(value, RunRecord):
        if value.comparison is None:
            raise TypeError(f"record {value.name!r} is a {value.kind} record, not a comparison")
        return value.comparison
    return value


# ---------------------------------------------------------------------------------- rerun


def rerun(record: RunRecord, **overrides):
    """Run ``record``'s configuration again; returns what the run returns (a History for a train
    or train_model record, a Comparison for a compare record; none writes a record). On the CPU, at
    the record's thread count (set for the rerun), the losses equal the record's bit for bit.
    A train_worker record launches ``train_worker`` again with its arguments.

    A train record starts from its ``initial.pt`` (model, optimizer, scheduler and RNG states as they
    were before step 1) with its arguments (steps, seed, batch settings, loss); a compare record
    runs every configuration again on its model, seeds and batches; a train_model record launches
    ``train_model`` again on as many ranks from its initial model (rank 0's History comes back;
    ``device=`` and launch's other keywords go to the launch). ``overrides`` replace arguments
    the record could not keep (``batches=``, ``loss_fn=``, ``model=``, ...) or change one
    (``device=``)."""
    if not isinstance(record, RunRecord):
        raise TypeError(f"record must be a RunRecord (muonlab.runs.load), got {type(record).__name__}")
    threads = record.provenance.get("threads")
    before = torch.get_num_threads()
    if isinstance(threads, int) and threads > 0:
        torch.set_num_threads(threads)  # a CPU matmul's sums split by thread: its bits depend on them
    try:
        if record.kind == "train":
            return _rerun_train(record, overrides)
        if record.kind == "compare":
            from .experiments.compare import compare, inputs_from_record

            inputs = inputs_from_record(record, overrides)
            configs = {name: c.settings for name, c in record.comparison.configs.items()}
            return compare(configs, **inputs, progress=False, record=False)
        if record.kind == "train_worker":
            return _rerun_train_worker(record, dict(overrides))
        return _rerun_train_model(record, dict(overrides))
    finally:
        torch.set_num_threads(before)


def kept_inputs(record: RunRecord, given, keys=("batches", "val_batches")) -> dict:
    """The batch sources and the loss ``record`` kept (a dataset from data.pt, an importable
    function, a loss's name), but for those in ``given``; a ValueError names one that was not kept."""
    out, data = {}, None
    for key in keys:
        described = record.config.get(key)
        if key in given or described is None:
            continue
        if described.get("kind") == "dataset" and described.get("kept"):
            data = record.read("data") if data is None else data
            out[key] = tuple(data[key])
        elif described.get("kind") == "callable" and described.get("function"):
            out[key] = import_ref(described["function"])
        else:
            raise ValueError(f"record {record.name!r}: its {key} ({described.get('kind')}) was not kept: "
                             f"pass {key}=")
    if "loss_fn" not in given:
        loss = rebuild_loss(record.config.get("loss_fn"))
        if unbuilt(loss):
            raise ValueError(f"record {record.name!r}: its loss_fn ({loss['__repr__']}) was not kept: pass loss_fn=")
        out["loss_fn"] = loss
    return out


def _kept_initial(record: RunRecord) -> dict:
    initial = record.read("initial")
    if initial is None:
        raise ValueError(f"record {record.name!r} kept no initial model ("
                         f"{record.config.get('initial_not_kept', 'not saved')}): pass model= to rerun it")
    return initial


def _rerun_train(record: RunRecord, overrides: dict):
    from .train import train

    initial = _kept_initial(record)
    args = {**decode(record.config["train"]), **kept_inputs(record, overrides), **overrides}
    rng = initial["rng"]
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():  # the caller's RNG is left as it was
        # an unpickled scheduler no longer wraps its optimizer's step, which torch takes for an override
        warnings.filterwarnings("ignore", message=r"Seems like `optimizer.step\(\)` has been overridden")
        torch.set_rng_state(rng["cpu"])
        if rng.get("cuda") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
        return train(initial["model"], initial["optimizer"], scheduler=initial["scheduler"], progress=False,
                     record=False, **args)


LAUNCH_KEYWORDS = ("backend", "device", "timeout_s", "startup_timeout_s", "name", "progress", "warm")
"""launch()'s own keywords: a train_model rerun passes these to the launch, the rest to train_model."""


def _rerun_train_model(record: RunRecord, overrides: dict):
    from .experiments.any_model import train_model
    from .launcher import launch

    args = decode(record.config["train_model"])
    world = args.pop("world_size")
    args.pop("units", None)
    launch_kwargs = {k: overrides.pop(k) for k in LAUNCH_KEYWORDS if k in overrides}
    inputs = kept_inputs(record, overrides, keys=("batches",))
    model = overrides.pop("model", None) or _kept_initial(record)["model"]
    batches = overrides.pop("batches", None) or inputs["batches"]
    loss = overrides.pop("loss_fn") if "loss_fn" in overrides else inputs["loss_fn"]
    out = launch(train_model, world, model, loss, batches, **{**args, **overrides, "record": False},
                 **{"progress": False, **launch_kwargs})
    return out[0]["history"]


def _rerun_train_worker(record: RunRecord, overrides: dict):
    """``train_worker`` launched again with the record's arguments (its GPT is built from the seed);
    a History of the mean losses and optimizer step seconds, as the record keeps them."""
    from .experiments.train import train_worker
    from .launcher import launch
    from .train import History

    args = decode(record.config["train_worker"])
    world = args.pop("world_size")
    launch_kwargs = {k: overrides.pop(k) for k in LAUNCH_KEYWORDS if k in overrides}
    out = launch(train_worker, world, **{**args, **overrides, "record": False}, **{"progress": False, **launch_kwargs})
    return History(steps=[*range(1, len(out[0]["mean_losses"]) + 1)], train_loss=out[0]["mean_losses"],
                   opt_time_s=out[0]["step_seconds"], ns_choices=out[0]["ns_choices"])


# ---------------------------------------------------------------------------------- TensorBoard


def export_tensorboard(record: RunRecord, logdir: str | None = None) -> str:
    """Write ``record``'s scalars (train/val loss, step seconds; a comparison's per-run losses) as
    TensorBoard event files under ``logdir`` (default ``<record folder>/tensorboard``); needs the
    optional ``tensorboard`` package. Returns the folder."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise ImportError("export_tensorboard needs the tensorboard package (pip install tensorboard)") from e
    if not isinstance(record, RunRecord):
        raise TypeError(f"record must be a RunRecord, got {type(record).__name__}")
    logdir = logdir or os.path.join(record.path or runs_dir(), "tensorboard")
    series = []
    if record.history is not None:
        h = record.history
        series = [("", "train_loss", h.steps, h.train_loss), ("", "val_loss", h.val_steps, h.val_loss),
                  ("", "step_time_s", h.steps, h.step_time_s)]
    if record.comparison is not None:
        series = [(f"{r.config}/seed{r.seed}", "train_loss", range(1, len(r.train_loss) + 1), r.train_loss)
                  for c in record.comparison.configs.values() for r in c.runs]
    for run in dict.fromkeys(s[0] for s in series):
        with SummaryWriter(os.path.join(logdir, run) if run else logdir) as w:
            for _, tag, steps, values in (s for s in series if s[0] == run):
                for step, value in zip(steps, values):
                    if math.isfinite(value):
                        w.add_scalar(tag, value, step)
    return logdir
