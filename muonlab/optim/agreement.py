"""Do all ranks take the same step, and is every rank's gradient finite? One exchange per step.

A step's collectives line up only if every rank plans the same batches, and replicas (DDP) stay
equal only if every rank applies the same settings. A rank can drift from the others at any step:
a gradient that is None on one rank only, a setting changed on one rank, a parameter added on one.
Caught only when a rank re-plans, such a step would hang in mismatched collectives (the ranks that
did not re-plan go straight into the step's own) or silently diverge. And a non-finite gradient on
one rank must make every rank skip (or raise), or replicas part ways.

Replicas (DDP) also part ways when their gradients differ at some step (DDP forgotten after a
first step on the same batch, a rank skipping the all-reduce): each matrix would take its owner
rank's gradient, the replicas staying equal, with no error.

So each step starts with one control exchange: each rank sends every rank three int64s, an 8-byte
digest of what it is about to do (each parameter with a gradient: its name, global shape, dtype and
settings; the step's options), its non-finite flag (muonlab.optim.nonfinite) and a fingerprint of
its replicated gradients (muonlab.optim.replicas; 0 where none is taken), in one
all_to_all_single. It runs on gloo, on the host: under NCCL a side group over the same ranks, so it
never waits for the GPU itself. It comes before the step's first collective of its own and before
anything is written, so a mismatch or a flag changes nothing. Only on a mismatch do the ranks
exchange their full descriptions (or, for fingerprints, per-matrix values), and every rank raises
the same ValueError naming the parameter, the setting and the ranks. A flag comes before the
fingerprints: a non-finite gradient is the non-finite check's (skip or raise), never called a
replica mismatch. Unnamed parameters are described by position, so two same-shape unnamed
parameters listed in another order on one rank look alike: name them (``(name, tensor)`` pairs or
muon_param_groups).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch
import torch.distributed as dist

Description = list[tuple]
"""(kind, name, ((field, value), ...)) per item: "muon"/"adamw" parameters with a gradient, "options"."""


def digest(description: Description) -> int:
    """A stable 63-bit digest (the same on every rank: no per-process hash seed)."""
    return int.from_bytes(hashlib.blake2b(repr(description).encode(), digest_size=8).digest(), "little") >> 1


class Agreement:
    """The check, with the gloo groups it runs on (one per process group, made on first use)."""

    def __init__(self):
        self._gloo: dict[int, object] = {}

    def _host_group(self, group):
        """``group`` itself on gloo; otherwise (NCCL) its gloo side group."""
        return group if dist.get_backend(group) == "gloo" else self._side_group(group)

    def _side_group(self, group):
        """A gloo group over ``group``'s ranks, made once per process group. Only its members take
        part in making it (use_local_synchronization), so ranks outside ``group`` need not call."""
        key = id(group)
        if key not in self._gloo:
            ranks = dist.get_process_group_ranks(group)
            self._gloo[key] = dist.new_group(ranks=ranks, backend="gloo", use_local_synchronization=True)
        return self._gloo[key]

    def check(self, group, step_digest: int, flagged: bool, describe: Callable[[], Description],
              fingerprint: int = 0, name_replicas: Callable[[object], str] | None = None) -> list[int]:
        """The step's control exchange over ``group``: raise the same ValueError on every rank unless
        all send the same ``step_digest`` (``describe()`` gives this rank's full description then);
        else return the global ranks whose ``flagged`` (a non-finite gradient) was True, the same
        list on every rank; else raise unless all send the same ``fingerprint`` (of the replicated
        gradients: ``name_replicas(group)``, called on every rank, exchanges what names the
        parameter and returns the message)."""
        side = self._host_group(group)
        size = dist.get_world_size(side)
        # Blocking, in a loop on 2 cores: 0.53 ms at 2 ranks and 1.85 at 4, against 0.63 and 1.56
        # for an all-reduce of (digest, -digest) under MAX: neither clearly cheaper here, and the
        # all-to-all carries the flags and fingerprints along at no cost
        rows = torch.empty(3 * size, dtype=torch.int64)
        mine = torch.tensor([step_digest, int(flagged), fingerprint], dtype=torch.int64)
        dist.all_to_all_single(rows, mine.repeat(size), group=side)
        rows = rows.view(size, 3).tolist()
        ranks = dist.get_process_group_ranks(side)
        if any(d != rows[0][0] for d, _, _ in rows):
            everyone: list = [None] * size
            dist.all_gather_object(everyone, describe(), group=side)
            raise ValueError(first_difference(everyone, ranks))
        flagged_ranks = [rank for rank, (_, flag, _) in zip(ranks, rows) if flag]
        if flagged_ranks:  # a non-finite gradient's fingerprint says nothing of the replicas
            return flagged_ranks
        if any(f != rows[0][2] for _, _, f in rows):
            raise ValueError(name_replicas(side) if name_replicas is not None else
                             "replicated gradients differ between ranks")
        return []

    def __getstate__(self):
        return {}  # groups are live communicators: made again on first use

    def __setstate__(self, state):
        self.__init__()

    def __deepcopy__(self, memo):
        return Agreement()


def first_difference(everyone: list[Description], ranks: list[int]) -> str:
    """What the first rank that differs from the first one does differently, in words."""
    first = everyone[0]
    for rank, theirs in zip(ranks[1:], everyone[1:]):
        if theirs == first:
            continue
        a, b = {item[:2]: dict(item[2]) for item in first}, {item[:2]: dict(item[2]) for item in theirs}
        for (kind, name), fields in a.items():
            what = "options of the step" if kind == "options" else f"{kind} parameter {name!r}"
            if (kind, name) not in b:
                return (f"ranks disagree on the step: {what} has a gradient on rank {ranks[0]} and none on rank "
                        f"{rank} (every rank must step the same parameters; a gradient of None skips one)")
            differ = [f"{k} {v!r} on rank {ranks[0]}, {b[(kind, name)].get(k)!r} on rank {rank}"
                      for k, v in fields.items() if b[(kind, name)].get(k) != v]
            if len(differ) > 1:  # a setting that differs also differs in the config made from it
                differ = [d for d in differ if not d.startswith("newton_schulz ")]
            if differ:
                return f"ranks disagree on the step: {what}: " + "; ".join(differ)
        for kind, name in b:
            if (kind, name) not in a:
                return (f"ranks disagree on the step: {kind} parameter {name!r} has a gradient on rank {rank} "
                        f"and none on rank {ranks[0]}")
        return (f"ranks disagree on the step: rank {ranks[0]} and rank {rank} list the same parameters in "
                "different orders")
    return "ranks disagree on the step"  # pragma: no cover - digests differ only with descriptions
