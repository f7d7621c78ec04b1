"""Is any of this rank's gradients non-finite? One fused pass, read once.

``found(grads)`` runs one fused pass per (device, dtype) over the local gradients (torch's AMP
non-finite check with an inverse scale of 1.0: it rewrites each value as itself and raises a flag
on an inf or NaN) and reads the flag: on a CPU a plain read, on a GPU one synchronisation. Ranks
learn each other's flags in the step's one control exchange (muonlab.optim.agreement), before
anything is written. Names of the culprits (``culprits``) are looked for only when the flag is up,
so the common path does no per-gradient work beyond grouping and the fused call. ``flag_on`` is
the same pass without the read, for the decision on the device (muonlab.optim.step_gate).
``found`` reads the replicas' gradient fingerprints with the flag, in the same read.

``control`` is a Muon step's commit decision, taken before anything is written: this check and
the ranks' agreement in one exchange (the module a step calls for both, once).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from ..comm.collectives import rank_or_zero
from ..comm.specs import local_shard, local_shards
from .prepared import PreparedStep, step_digest
from .replicas import fingerprints, fold, name_the_difference
from .step_inputs import plan_names
from .validation import fmt_shape


FUSED_CHECK_DTYPES = {"cuda": (torch.float16, torch.float32, torch.float64)}
"""Per device type whose fused non-finite check doesn't take every floating dtype, those it takes:
torch's CUDA kernel has no bf16 (AmpKernels.cu dispatches the float types and half), so bf16
grads on a GPU take ``_largest_magnitudes_into``."""


def _flag_into(found: torch.Tensor, grads: list[torch.Tensor], one: torch.Tensor) -> None:
    """Raise ``found`` (a one-element float tensor on the grads' device) if any of ``grads`` (one
    device, one dtype) is non-finite; ``one`` is the inverse scale 1.0 on that device."""
    takes = FUSED_CHECK_DTYPES.get(grads[0].device.type)
    if takes is None or grads[0].dtype in takes:
        try:
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, one)
            return
        except RuntimeError:
            pass  # grads that can't be written in place (expanded views, inference tensors)
    _largest_magnitudes_into(found, grads)


def _largest_magnitudes_into(found: torch.Tensor, grads: list[torch.Tensor]) -> None:
    """``_flag_into`` without writing the grads: each one's largest magnitude, one fused reduction
    for the list (an inf or NaN anywhere makes it inf or NaN), and no temporary of a grad's size
    (an ``isfinite`` per grad takes a bool per element: a bf16 bank's check broke its workspace
    budget on a GPU, and it launched twice per grad)."""
    sized = [g for g in grads if g.numel()]  # an empty tensor has no largest magnitude
    if sized:
        found += torch.stack(torch._foreach_norm(sized, float("inf"))).isfinite().logical_not().any().float()


def _flags_by_device(grads: Sequence[torch.Tensor], plain: bool = False) -> dict[torch.device, torch.Tensor]:
    """Per device of ``grads`` (plain tensors or DTensors: their local shards; ``plain``: none is a
    DTensor), a one-element fp32 flag, raised by one fused pass per dtype: nothing read."""
    by_device: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = {}
    for g in grads if plain else local_shards(grads):
        by_device.setdefault(g.device, {}).setdefault(g.dtype, []).append(g)
    flags = {}
    for dev, by_dtype in by_device.items():
        flag = torch.zeros(1, dtype=torch.float32, device=dev)
        one = torch.ones(1, dtype=torch.float32, device=dev)
        for gs in by_dtype.values():
            _flag_into(flag, gs, one)
        flags[dev] = flag
    return flags


def found(grads: Sequence[torch.Tensor], also: torch.Tensor | None = None, also_read: list | None = None,
          plain: bool = False) -> bool:
    """Whether any of ``grads`` (plain tensors or DTensors: their local shards) holds an inf or
    NaN: one fused pass per (device, dtype), then one read of the flag per device. ``also`` (a 1-D
    integer tensor: the replicas' gradient fingerprints, muonlab.optim.replicas) is read in the
    same read as its device's flag, its values put in ``also_read``: no synchronisation of its own.
    ``plain``: no grad is a DTensor (their local shards need no look-up)."""
    flags = _flags_by_device(grads, plain)
    if also is not None:
        flag = flags.pop(also.device, None)
        head = torch.zeros(1, dtype=also.dtype, device=also.device) if flag is None else (flag > 0).to(also.dtype)
        flag_value, *values = torch.cat((head, also)).tolist()
        also_read[:] = values
        if flag_value:
            return True
    return any(flag.item() > 0 for flag in flags.values())


def flag_on(grads: Sequence[torch.Tensor], device: torch.device, plain: bool = False) -> torch.Tensor:
    """``found`` without the read: a 0-dim fp32 tensor on ``device``, above 0 when a grad holds an
    inf or NaN (muonlab.optim.step_gate decides the step on the device with it)."""
    total = torch.zeros((), dtype=torch.float32, device=device)
    for flag in _flags_by_device(grads, plain).values():
        total += flag.to(device, non_blocking=True).view(())
    return total


def culprits(grads: Sequence[torch.Tensor], name_of: Callable[[int], str] | None = None) -> list[str]:
    """Names of the grads holding an inf or NaN (``name_of(i)`` names the i-th; default: its
    position and local shape): the slow per-grad look, for the error or the stats once ``found``
    said there is one."""
    local = [local_shard(g) for g in grads]
    if name_of is None:
        name_of = lambda i: f"grad {i} of shape {tuple(local[i].shape)}"  # noqa: E731
    return [name_of(i) for i, g in enumerate(local) if not torch.isfinite(g).all()]


def named_culprits(checked: tuple, names: dict) -> list[str]:
    """The parameters among ``checked`` whose grad holds an inf or NaN, by name (or shape)."""
    return culprits([p.grad for p in checked], lambda i: names.get(
        checked[i], f"of shape {fmt_shape(checked[i].shape)}"))


def control(prepared: PreparedStep, settings: tuple, options, agreement, names: dict, describe,
            seconds: dict) -> tuple[list[int], list[str]]:
    """The step's commit decision, before anything is written: the non-finite check's flag of
    this rank (one fused pass over the grads) and the fingerprint of its replicated gradients
    (read with the flag), then one exchange with the other ranks of the step's group carrying
    them and the step's digest (``agreement.check``, an ``Agreement``: a rank that disagrees, or
    replicas whose gradients differ, make every rank raise the same error; ``describe()`` says what
    this rank is about to do, where ranks disagree). Returns the global ranks with a non-finite
    gradient (the same on every rank) and this rank's culprits (``names``: parameter -> name);
    raises under ``nonfinite="raise"``. ``settings``: the groups' settings as checked this step;
    ``seconds``: "check" (the pass) and "wait" (the exchange), host seconds, when the check is on.

    The fingerprint rides on the host's read of the flag: with ``nonfinite="ignore"`` or
    ``nonfinite_decision="device"`` (and so captured steps) no flag is read, and reading one
    would synchronise a GPU step that otherwise does not; there the replicas' gradients are
    compared when a plan is made only (muonlab.optim.replicas.check_ranks_agree)."""
    checking = options.nonfinite != "ignore" and options.nonfinite_decision == "host"  # else: the StepGate
    t0 = time.perf_counter()
    replicas = prepared.replicas if checking else ()
    values: list[int] = []  # the replicas' fingerprints, read with the flag
    flagged = checking and found([p.grad for p in prepared.checked],
                                 fingerprints([p.grad for p in replicas]) if replicas else None, values, prepared.plain)
    t1 = time.perf_counter()
    group = prepared.check_group
    if group is not None:
        bad_ranks = agreement.check(
            group, step_digest(prepared, settings), flagged, describe, fold(values) if replicas else 0,
            lambda side: name_the_difference(side, plan_names(prepared.checked, prepared.indices, replicas, names),
                                             replicas, values))
    else:
        bad_ranks = [rank_or_zero()] if flagged else []
    if checking:
        seconds.update(check=t1 - t0, wait=time.perf_counter() - t1)
    if not bad_ranks:
        return [], []
    named = named_culprits(prepared.checked, names) if flagged else []
    if options.nonfinite == "raise":
        mine = f"; here: {', '.join(named)}" if named else ""
        raise ValueError(f"non-finite gradient on rank(s) {bad_ranks}{mine}")
    return bad_ranks, named
