"""Where the momentum of replicated (DDP) matrices lives, and how it follows its owner.

A replicated matrix is orthogonalized by one owner rank of its group (the ``owner`` path), and its
momentum lives on that rank alone: a ZeRO-1 style saving. The planner balances owners over the
matrices that have a gradient, so an owner can change between steps; the momentum's home then
broadcasts it to the new owner before the step writes anything (``MomentumHomes.relocate``), and a
plan in which every rank orthogonalizes it ("redundant") spreads it to all (``spread``).
Checkpoints want every rank to hold every state tensor (``consolidate``) and training wants it back
on one (``release``).

``MomentumHomes`` owns the map {Muon entry index: global rank holding its momentum}; the caller
gives it what it reads: the Muon entries ((group, parameter) pairs in the optimizer's order), the
optimizer's ``state``, the state stores (``offload``), the plan's owners and the step's counter.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm.collectives import CommCounter, rank_or_zero
from ..comm.engine import COMMUNICATION
from ..comm.specs import local_shard
from .saved_state import state_for

MOMENTUM_MOVE = "momentum_move"
"""``last_step_stats()``'s key (beside the plan's paths) for the momentum of replicated matrices
broadcast between ranks during the step: a matrix whose owner changed (``MomentumHomes.relocate``)
or that every rank orthogonalizes from now on (``MomentumHomes.spread``)."""


def _count_broadcast(counter: CommCounter, tensor: torch.Tensor, src: int, group) -> None:
    """One broadcast of ``tensor`` from global rank ``src`` over ``group``, in the step's counter:
    the source sends it to every other rank of the group, each of them receives it once."""
    nbytes = tensor.numel() * tensor.element_size()
    if dist.get_rank() == src:
        counter.add(MOMENTUM_MOVE, nbytes * (dist.get_world_size(group) - 1), 0)
    else:
        counter.add(MOMENTUM_MOVE, 0, nbytes)


def _holds_momentum(state: dict) -> bool:
    """Whether a replicated matrix's state here holds its momentum: a buffer that is not all
    zeros. init_state() makes zeros on every rank (distributed checkpointing wants the same keys
    everywhere), which must not pass for the momentum; momentum that is truly all zeros is then
    equally right wherever it is taken from."""
    buf = state.get("momentum_buffer")
    return buf is not None and bool(local_shard(buf).any())


def _drop_momentum(state: dict, p: torch.Tensor) -> None:
    """Drop p's momentum from ``state``; an update rule's state stays (every replica keeps its own,
    see muonlab.optim.rule_step)."""
    entry = state.get(p)
    if entry is not None:
        entry.pop("momentum_buffer", None)
        if not entry:
            state.pop(p, None)


def _broadcast_momentum(p: torch.Tensor, src: int, group, state: dict, offload, counter: CommCounter) -> None:
    """Rank ``src``'s momentum of ``p`` into this rank's own buffer (made if it has none), over
    ``group``, through its store (a collective backend may need it on the device)."""
    for _, (buf,) in offload.each([(0, p, state_for(state, p, "muon", offload))], ("momentum_buffer",)):
        _count_broadcast(counter, buf, src, group)
        dist.broadcast(buf, src=src, group=group)


class MomentumHomes:
    """The replicated matrices' momentum homes (see the module doc)."""

    def __init__(self, home: dict[int, int] | None = None):
        self.home: dict[int, int] = {} if home is None else home
        """Muon entry index -> global rank holding its momentum; absent: not known yet, found by
        ``resolve`` at the next step that needs it (a new optimizer, a loaded state dict)."""

    def owned(self, owners: dict, entries: list, state: dict) -> list[tuple[int, torch.Tensor, object, int]]:
        """(entry index, param, process group, global rank holding its momentum) for the replicated
        matrices of ``owners`` (the plan's, over every Muon entry): where its last step left it,
        else where ``resolve`` finds it."""
        self.resolve(owners, entries, state)
        return [(i, entries[i][1], pg, self.home[i]) for i, (pg, _, _) in owners.items()]

    def resolve(self, owners: dict, entries: list, state: dict) -> None:
        """Collective, only while some replicated matrix of ``owners`` has no known home (a new
        optimizer, after load_state_dict): each rank says which of them it holds momentum for
        (``_holds_momentum``), and a matrix's home becomes its owner if the owner holds it (or
        nobody does), else the first rank that does. After owners moved, each rank's own
        state_dict holds the momentum its rank was home to, which need not be the new owner's."""
        unknown: dict[int, list[int]] = {}  # per process group, in plan order (the same on every rank)
        for i, (pg, _, _) in owners.items():
            if i not in self.home:
                unknown.setdefault(id(pg), []).append(i)
        for members in unknown.values():
            pg = owners[members[0]][0]
            device = local_shard(entries[members[0]][1]).device  # NCCL gathers on the device
            mine = torch.tensor([float(_holds_momentum(state.get(entries[i][1], {}))) for i in members],
                                device=device)
            everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(pg))]
            dist.all_gather(everyone, mine, group=pg)
            held, ranks = torch.stack(everyone).cpu(), dist.get_process_group_ranks(pg)
            for k, i in enumerate(members):
                owner = owners[i][1]
                holders = [ranks[r] for r in held[:, k].nonzero().flatten().tolist()]
                self.home[i] = owner if not holders or owner in holders else holders[0]

    def relocate(self, owners: dict, entries: list, state: dict, offload, counter: CommCounter) -> None:
        """Collective: move replicated matrices' momentum to their owners in this step's plan.

        A replicated matrix's momentum lives on the rank that orthogonalizes it, and the planner
        balances owners over the matrices that have a gradient: when that set changes (or a
        setting changes the balance) a matrix can get a new owner, which would start from zero
        momentum (or read the stale buffer of an earlier turn) while the current one sits on its
        old home. So the home broadcasts it in the matrix's group; the new owner keeps it, every
        other rank drops its copy. Every rank plans alike, so all take part in the same moves.
        The broadcasts are counted in ``counter`` under MOMENTUM_MOVE."""
        self.resolve(owners, entries, state)
        me = dist.get_rank()
        moves = [(i, home, owners[i]) for i in owners if (home := self.home[i]) != owners[i][1]]
        for i, home, (pg, owner, _) in moves:
            p = entries[i][1]
            if me in (home, owner):  # the home's buffer, or the new owner's (made now if it has none)
                _broadcast_momentum(p, home, pg, state, offload, counter)
            else:  # a rank between them receives too (a broadcast reaches the whole group)
                scratch = torch.empty_like(local_shard(p), dtype=offload.dtype(p, "momentum_buffer"))
                _count_broadcast(counter, scratch, home, pg)
                dist.broadcast(scratch, src=home, group=pg)
        for i, (_, owner, _) in owners.items():
            self.home[i] = owner
            if me != owner:  # moved away, or a copy (init_state's zeros, a consolidation's): not kept
                _drop_momentum(state, entries[i][1])

    def spread(self, planned, entries: list, state: dict, offload, counter: CommCounter) -> None:
        """Collective: replicated matrices that ``planned`` (a plan with its specs, owners and
        groups) orthogonalizes on every rank (strategy "redundant") need their momentum on every
        rank, and it lives on one home since an earlier step's owner path: the home broadcasts
        it, and every rank holds it from now on."""
        for i, spec in planned.specs.items():
            if spec.layout != "replicated" or i in planned.owners or i not in self.home:
                continue
            _broadcast_momentum(entries[i][1], self.home.pop(i), planned.groups[spec.group][0], state, offload,
                                counter)

    def follow(self, planned, entries: list, state: dict, offload, tracer, counter: CommCounter) -> None:
        """Collective, where ``planned`` has owners or some home is known: momentum moved to this
        step's owners (``relocate``) and spread where every rank orthogonalizes (``spread``), the
        time tallied as the step's communication."""
        t0 = tracer.mark()
        if planned.owners:
            self.relocate(planned.owners, entries, state, offload, counter)
        if self.home:
            self.spread(planned, entries, state, offload, counter)
        tracer.tally(COMMUNICATION, t0, tracer.mark())

    @staticmethod
    def consolidate(owned: list, state: dict, offload) -> None:
        """Collective: each of ``owned``'s matrices (from ``owned``, taken before the state's zeros
        were made) has its momentum broadcast from its home into every rank's buffer."""
        items = [(k, p, state[p]) for k, (_, p, _, _) in enumerate(owned)]
        # through the store: a collective backend may need the buffer on the parameter's device
        for k, (buf,) in offload.each(items, ("momentum_buffer",)):
            _, _, pg, home = owned[k]
            dist.broadcast(buf, src=home, group=pg)

    def release(self, owned: list, state: dict) -> None:
        """Drop the momentum of ``owned``'s matrices whose home is another rank."""
        me = rank_or_zero()
        for i, p, _, home in owned:
            self.home[i] = home
            if home != me:
                _drop_momentum(state, p)
