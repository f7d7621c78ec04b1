"""A Muon step's commit decision, taken before anything is written (``control``): the non-finite
check and the ranks' agreement in one exchange."""

from __future__ import annotations

import time

from ..comm.collectives import rank_or_zero
from . import nonfinite
from .prepared import PreparedStep, step_digest
from .replicas import fingerprints, fold, name_the_difference
from .step_inputs import plan_names
from .step_stats import culprits


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
    flagged = checking and nonfinite.found([p.grad for p in prepared.checked],
                                           fingerprints([p.grad for p in replicas]) if replicas else None, values,
                                           prepared.plain)
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
    found = culprits(prepared.checked, names) if flagged else []
    if options.nonfinite == "raise":
        mine = f"; here: {', '.join(found)}" if found else ""
        raise ValueError(f"non-finite gradient on rank(s) {bad_ranks}{mine}")
    return bad_ranks, found
