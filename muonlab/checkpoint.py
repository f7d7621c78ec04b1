"""Save and load training state (model, Muon optimizer, step, lr scheduler) with
torch.distributed.checkpoint (DCP).

::

    from muonlab import checkpoint
    checkpoint.save("ckpt/step100", model, opt, step=100, scheduler=sched)
    ...
    step = checkpoint.load("ckpt/step100", model, opt, scheduler=sched)

Both are collective when torch.distributed is initialised (call them on every rank) and work in
a single process without it. The checkpoint is a DCP directory: every tensor is saved once, by
the ranks that hold its shards, in its global shape, so it loads on any world size (4 ranks ->
2 or 1, 2 -> 4) with resharding, for FSDP2 (DTensor) parameters and their optimizer state.

What Muon needs around DCP:

* every rank must present the same keys: ``opt.init_state()`` creates all state (zeros) before
  the first step, and ``opt.consolidate_state()`` has the owners of replicated (DDP) matrices
  broadcast their momentum (Muon keeps it on one owner only); ``opt.release_unowned_state()``
  drops the copies again after the save or load;
* expert banks under expert parallelism (``apply_ep``) hold different experts under the same
  name on each "ep" coordinate; they are saved under ``NAME@ep<r>of<n>`` so the ep groups do not
  overwrite each other (a checkpoint with experts therefore loads only with the same ep size);
* the step count, the scheduler's ``state_dict()`` and ``extra`` are written by rank 0 next to
  the tensors (``muonlab_meta.pt``), readable on any world size.
"""

from __future__ import annotations

import contextlib
import io
import os
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from ._base import dist_on, rank_or_zero, world_size_or_one
from .optim.validation import whole_number

__all__ = ["save", "load", "read_meta", "META_FILE"]

META_FILE = "muonlab_meta.pt"


@contextlib.contextmanager
def _quiet_single_process():
    """DCP warns that it assumes a single process when torch.distributed is off: that is intended."""
    with warnings.catch_warnings():
        if not dist_on():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _barrier() -> None:
    if dist_on() and dist.get_world_size() > 1:
        dist.barrier()


def _inner(model: torch.nn.Module) -> torch.nn.Module:
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def _ep_renames(model: torch.nn.Module) -> dict[str, str]:
    """FQN -> the name it is saved under, for expert banks placed by apply_ep."""
    # "@ep" is part of the checkpoint format, not the mesh axis name (MeshAxis.EP): renaming the
    # axis must not change the keys of checkpoints already on disk.
    out = {}
    for name, p in _inner(model).named_parameters():
        if hasattr(p, "_ep_rank") and getattr(p, "_ep_size", 1) > 1:
            out[name] = f"{name}@ep{p._ep_rank}of{p._ep_size}"
    return out


def _rename(msd: dict, osd: dict, renames: dict[str, str]) -> tuple[dict, dict]:
    if not renames:
        return msd, osd
    msd = {renames.get(k, k): v for k, v in msd.items()}
    osd = dict(osd)
    osd["state"] = {renames.get(k, k): v for k, v in osd.get("state", {}).items()}
    osd["param_groups"] = [
        {**g, "params": [renames.get(k, k) for k in g["params"]]} for g in osd.get("param_groups", [])
    ]
    return msd, osd


def _unrename(msd: dict, osd: dict, renames: dict[str, str]) -> tuple[dict, dict]:
    return _rename(msd, osd, {v: k for k, v in renames.items()})


def _strip_param_names(osd: dict) -> dict:
    # Muon keeps names outside param_groups; never let a copy of them into the checkpoint
    for g in osd.get("param_groups", []):
        g.pop("param_names", None)
    return osd


def _shape(t: Any) -> tuple[int, ...] | None:
    return tuple(t.shape) if torch.is_tensor(t) else None


def _check_against(path: str, saved: dict, state: dict, renames: dict[str, str]) -> None:
    """ValueError naming the first parameter / state tensor whose key or shape differs, or whose
    saved dtype is wider than its own; ``saved``: the checkpoint's state_dict_metadata."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    flat: dict[str, Any] = {}
    for name, t in state["model"].items():
        flat[f"model.{name}"] = t
    for name, entry in state["optim"]["state"].items():
        for key, t in entry.items():
            flat[f"optim.state.{name}.{key}"] = t
    model_keys = {k for k in saved if k.startswith("model.")}
    missing = [k for k in flat if k not in saved]
    if missing:
        what = missing[0]
        base = what.split(".", 1)[1].split("@ep")[0]
        ep_saved = sorted({k.split("@", 1)[1] for k in model_keys if k[6:].split("@ep")[0] == base and "@" in k})
        if ep_saved or "@ep" in what:
            raise ValueError(
                f"checkpoint {path!r} does not match the model's expert parallelism: expert bank {base!r} is "
                f"saved as {ep_saved or 'one unsplit bank'}, this rank wants {what.split('.', 1)[1]!r}; "
                f"load with the ep size used for saving"
            )
        kind = "parameter" if what.startswith("model.") else "optimizer state"
        raise ValueError(
            f"checkpoint {path!r} does not match the model: it has no {kind} {what.split('.', 1)[1]!r}"
            f" ({len(missing)} missing; checkpoint parameters: {sorted(k[6:] for k in model_keys)[:8]}...)"
        )
    # other ep coordinates' expert banks are not this rank's to load
    unexpected = sorted(k for k in model_keys if k not in flat and k[6:].split("@ep")[0] not in renames)
    if unexpected:
        raise ValueError(
            f"checkpoint {path!r} does not match the model: parameter {unexpected[0][6:]!r} is in the "
            f"checkpoint but not in the model ({len(unexpected)} such)"
        )
    # e.g. an untied checkpoint (state for lm_head.weight) into a tied model (state for tok_emb only)
    extra_state = sorted(k for k in saved if k.startswith("optim.state.") and k not in flat and "@ep" not in k)
    if extra_state:
        raise ValueError(
            f"checkpoint {path!r} does not match the optimizer: it holds optimizer state "
            f"{extra_state[0][len('optim.state.'):]!r} for a parameter the optimizer does not have "
            f"({len(extra_state)} such; were parameters tied or untied, or added to the optimizer?)"
        )
    for key, t in flat.items():
        meta = saved[key]
        shape = _shape(t)
        if shape is None or not isinstance(meta, TensorStorageMetadata):
            continue
        name = key.split(".", 1)[1] if key.startswith("model.") else key[len("optim.state."):]
        if shape != tuple(meta.size):
            raise ValueError(
                f"checkpoint {path!r} does not match the model: {name!r} has shape {tuple(meta.size)} "
                f"in the checkpoint and {shape} in the model"
            )
        if t.dtype != meta.properties.dtype and t.dtype.itemsize < meta.properties.dtype.itemsize:
            # loading rounds it to the narrower dtype: bits the checkpoint holds would be lost
            raise ValueError(
                f"checkpoint {path!r} holds {name!r} in {meta.properties.dtype}, the model/optimizer in "
                f"{t.dtype}: loading would round it. Build the model (or momentum_dtype) in "
                f"{meta.properties.dtype}, or cast the checkpoint yourself"
            )


def _check_files(path: str, storage_data: dict) -> None:
    """Every data file holds the bytes the checkpoint's metadata places in it: a file cut short (a
    copy or a save interrupted) is refused here, before loading writes into any tensor."""
    needed: dict[str, int] = {}
    for info in storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = os.path.join(path, name)
        have = os.path.getsize(file) if os.path.exists(file) else None
        if have is None or have < size:
            raise ValueError(f"checkpoint {path!r} is damaged: {name} holds "
                             f"{'nothing' if have is None else f'{have} bytes'}, its metadata needs {size}; "
                             "nothing was loaded")


def save(
    path: str | os.PathLike,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    step: int,
    *,
    scheduler: Any = None,
    extra: Any = None,
) -> None:
    """Save ``model``, ``opt`` (Muon or any torch optimizer), ``step``, ``scheduler`` and ``extra``.

    Collective when torch.distributed is initialised: call it on every rank with the same
    ``path``. ``model`` may be plain, FSDP2-sharded, DDP-wrapped or expert-parallel. ``extra``
    (any picklable object, from rank 0) comes back from :func:`read_meta`.
    """
    path = os.fspath(path)
    if os.path.lexists(path) and not os.path.isdir(path):  # DCP's own error is buried in a BaseException
        raise FileExistsError(f"checkpoint path {path!r} is an existing file, not a folder: save writes a folder")
    # the small part first, on every rank: a bad step, scheduler or extra raises before any byte
    # is written (over an older checkpoint, its tensors would otherwise sit beside the old step)
    meta = io.BytesIO()
    torch.save(dict(step=_step_count(step), scheduler=None if scheduler is None else scheduler.state_dict(),
                    extra=extra, world_size=world_size_or_one(),
                    skipped_steps=getattr(opt, "skipped_steps", None),  # Muon's count of non-finite skips
                    tied=_tied_groups(model), torch_version=torch.__version__), meta)
    has_muon_state = hasattr(opt, "consolidate_state")
    if has_muon_state:
        opt.consolidate_state()  # every state tensor on every rank (made where missing), as DCP wants
    try:
        msd, osd = get_state_dict(model, opt)
        osd = _strip_param_names(osd)
        msd, osd = _rename(msd, osd, _ep_renames(model))
        meta_path = os.path.join(path, META_FILE)
        if rank_or_zero() == 0 and os.path.exists(meta_path):
            os.remove(meta_path)  # over an older checkpoint: a save cut short now reads as incomplete
        _barrier()
        with _quiet_single_process():
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
        if rank_or_zero() == 0:
            tmp = meta_path + ".tmp"
            with open(tmp, "wb") as f:
                f.write(meta.getvalue())
            os.replace(tmp, meta_path)
        _barrier()
    finally:
        if has_muon_state:
            opt.release_unowned_state()


def _step_count(step) -> int:
    count = whole_number(step)
    if count is None:
        raise TypeError(f"step must be an int (the training step saved with the checkpoint), got {step!r}")
    if count < 0:  # resumed training would run range(step, steps)
        raise ValueError(f"step must be >= 0 (the training steps done before this checkpoint), got {step!r}")
    return count


def read_meta(path: str | os.PathLike) -> dict:
    """The small, rank-independent part of a checkpoint: step, scheduler state, extra, world size."""
    path = os.fspath(path)
    meta_path = os.path.join(path, META_FILE)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no checkpoint at {path!r} (not a directory)")
    if not os.path.exists(meta_path) or not os.path.exists(os.path.join(path, ".metadata")):
        raise FileNotFoundError(
            f"{path!r} is not a complete muonlab checkpoint (missing {META_FILE} or DCP .metadata; "
            f"was the save interrupted?)"
        )
    return torch.load(meta_path, weights_only=False)


def load(
    path: str | os.PathLike,
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    *,
    scheduler: Any = None,
) -> int:
    """Load a checkpoint written by :func:`save` into ``model``/``opt`` (and ``scheduler``); return
    the saved step.

    Collective when torch.distributed is initialised. The world size and sharding may differ from
    the save's (DCP reshards). Raises FileNotFoundError for a missing or incomplete checkpoint and
    ValueError for any mismatch the checkpoint's metadata shows (a parameter's or state tensor's
    name or shape, tied against untied parameters, the optimizer's state keys or parameter
    groups, the expert-parallel size, a scheduler without saved state, a tensor saved in a wider
    dtype than the one it would load into, a data file shorter than its metadata says), all
    checked before anything is written: after such an error the model, optimizer and scheduler
    are as before. Bytes damaged in place (a file of the right size) surface only while loading
    (DCP keeps no checksums): the tensors read by then are overwritten.
    """
    path = os.fspath(path)
    meta = read_meta(path)
    if scheduler is not None and meta["scheduler"] is None:
        raise ValueError(f"checkpoint {path!r} holds no lr scheduler state, but a scheduler was given")
    _check_tied(path, meta, model)
    # Building the state to load creates the optimizer's missing state (zeros): an error before
    # anything is read puts the optimizer's state back as it was.
    state_before = {p: dict(s) for p, s in opt.state.items()}
    try:
        state, renames = _state_to_load(model, opt)
        metadata = dcp.FileSystemReader(path).read_metadata()  # read once, for the three checks
        _check_against(path, metadata.state_dict_metadata, state, renames)
        _check_files(path, metadata.storage_data)
        _check_param_groups(path, metadata.state_dict_metadata, state["optim"], renames)
    except BaseException:
        opt.state.clear()
        opt.state.update(state_before)
        raise
    try:
        with _quiet_single_process():
            dcp.load(state, checkpoint_id=path)
        msd, osd = _unrename(state["model"], state["optim"], renames)
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
    finally:
        if hasattr(opt, "release_unowned_state"):
            opt.release_unowned_state()
    if scheduler is not None:
        scheduler.load_state_dict(meta["scheduler"])
    if meta.get("skipped_steps") is not None and hasattr(opt, "skipped_steps"):  # absent before it was saved
        opt.skipped_steps = int(meta["skipped_steps"])
    return int(meta["step"])


def _state_to_load(model: torch.nn.Module, opt: torch.optim.Optimizer) -> tuple[dict, dict[str, str]]:
    """{"model", "optim"} state dicts under their checkpoint names (DCP loads into them in place),
    and the expert-bank renames used."""
    if hasattr(opt, "init_state"):
        opt.init_state()
    msd, osd = get_state_dict(model, opt)
    osd = _strip_param_names(osd)
    renames = _ep_renames(model)
    msd, osd = _rename(msd, osd, renames)
    return {"model": msd, "optim": osd}, renames


def _tied_groups(model: torch.nn.Module) -> list[list[str]]:
    """Names that share one parameter (tied embeddings), each group sorted."""
    names: dict[int, list[str]] = {}
    for name, p in _inner(model).named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return sorted(sorted(group) for group in names.values() if len(group) > 1)


def _check_tied(path: str, meta: dict, model: torch.nn.Module) -> None:
    # Checkpoints from before "tied" was recorded are still checked through their optimizer
    # state keys (a tied parameter has one state entry, untied ones two).
    if "tied" not in meta:
        return
    saved, here = [list(g) for g in meta["tied"]], _tied_groups(model)
    if saved != here:
        def say(groups):
            return " and ".join(" = ".join(map(repr, g)) for g in groups) or "no parameters"

        raise ValueError(
            f"checkpoint {path!r} does not match the model's tied parameters: the checkpoint ties "
            f"{say(saved)}, the model ties {say(here)} (e.g. GPTConfig.tie_embeddings differs)"
        )


def _base_name(key: str) -> str:
    return key.split("@ep", 1)[0]


def _check_param_groups(path: str, saved_keys: dict, osd: dict, renames: dict[str, str]) -> None:
    """The optimizer's parameter groups hold the same parameters, in the same order, as saved."""
    num_saved = len({k.split(".")[2] for k in saved_keys if k.startswith("optim.param_groups.")})
    here = [[_base_name(n) for n in g["params"]] for g in osd.get("param_groups", [])]
    if num_saved != len(here):
        raise ValueError(
            f"checkpoint {path!r} does not match the optimizer: it has {num_saved} parameter groups, "
            f"the optimizer {len(here)}"
        )
    # Only the groups' parameter lists are read (small objects); nothing is written anywhere.
    groups: dict = {"optim": {"param_groups": [{"params": []} for _ in range(num_saved)]}}
    with _quiet_single_process():
        dcp.load(groups, checkpoint_id=path)
    for i, (group, names) in enumerate(zip(groups["optim"]["param_groups"], here)):
        saved = [_base_name(n) for n in group["params"]]
        if saved != names:
            diff = sorted(set(saved) ^ set(names)) or ["the same names in another order"]
            raise ValueError(
                f"checkpoint {path!r} does not match the optimizer: parameter group {i} holds "
                f"{len(saved)} parameters in the checkpoint and {len(names)} in the optimizer "
                f"(differing: {diff[:4]})"
            )
