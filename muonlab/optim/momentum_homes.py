"""Where the momentum of replicated (DDP) matrices lives, and how it follows its owner.

A replicated matrix is orthogonalized by one owner rank of its group (the ``owner`` path), and its
momentum lives on that rank alone: a ZeRO-1 style saving. The planner balances owners over the
matrices that have a gradient, so an owner can change between steps; the momentum's home then
broadcasts it to the new owner before the step writes anything (``_relocate_momentum``), and a
plan in which every rank orthogonalizes it ("redundant") spreads it to all (``_spread_momentum``).
Checkpoints want every rank to hold every state tensor (``consolidate_state``) and training wants
it back on one (``release_unowned_state``).

``MomentumHomes`` is a mixin of ``muonlab.optim.Muon``: it reads the optimizer's ``state``,
``_muon_entries()``, ``_plan_for()``, ``_state_for()``, ``init_state()`` and ``_offload`` (the
state stores), and keeps ``_replica_home`` ({Muon entry index: global rank holding its momentum}).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm.collectives import CommCounter, rank_or_zero
from ..comm.specs import local_shard

MOMENTUM_MOVE = "momentum_move"
"""``last_step_stats()``'s key (beside the plan's paths) for the momentum of replicated matrices
broadcast between ranks during the step: a matrix whose owner changed (``_relocate_momentum``)
or that every rank orthogonalizes from now on (``_spread_momentum``)."""


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


class MomentumHomes:
    """The replicated matrices' momentum homes (see the module doc); a mixin of Muon."""

    _replica_home: dict[int, int]

    def _owned(self) -> list[tuple[int, torch.Tensor, object, int]]:
        """(entry index, param, process group, global rank holding its momentum) for replicated
        (DDP) matrices: where its last step left it, else where ``_resolve_homes`` finds it."""
        entries = self._muon_entries()
        owners = self._plan_for(tuple(range(len(entries)))).owners
        self._resolve_homes(owners)
        return [(i, entries[i][1], pg, self._replica_home[i]) for i, (pg, _, _) in owners.items()]

    def _resolve_homes(self, owners: dict) -> None:
        """Collective, only while some replicated matrix of ``owners`` has no known home (a new
        optimizer, after load_state_dict): each rank says which of them it holds momentum for
        (``_holds_momentum``), and a matrix's home becomes its owner if the owner holds it (or
        nobody does), else the first rank that does. After owners moved, each rank's own
        state_dict holds the momentum its rank was home to, which need not be the new owner's."""
        entries = self._muon_entries()
        unknown: dict[int, list[int]] = {}  # per process group, in plan order (the same on every rank)
        for i, (pg, _, _) in owners.items():
            if i not in self._replica_home:
                unknown.setdefault(id(pg), []).append(i)
        for members in unknown.values():
            pg = owners[members[0]][0]
            device = local_shard(entries[members[0]][1]).device  # NCCL gathers on the device
            mine = torch.tensor([float(_holds_momentum(self.state.get(entries[i][1], {}))) for i in members],
                                device=device)
            everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(pg))]
            dist.all_gather(everyone, mine, group=pg)
            held, ranks = torch.stack(everyone).cpu(), dist.get_process_group_ranks(pg)
            for k, i in enumerate(members):
                owner = owners[i][1]
                holders = [ranks[r] for r in held[:, k].nonzero().flatten().tolist()]
                self._replica_home[i] = owner if not holders or owner in holders else holders[0]

    def _relocate_momentum(self, owners: dict, counter: CommCounter) -> None:
        """Collective: move replicated matrices' momentum to their owners in this step's plan.

        A replicated matrix's momentum lives on the rank that orthogonalizes it, and the planner
        balances owners over the matrices that have a gradient: when that set changes (or a
        setting changes the balance) a matrix can get a new owner, which would start from zero
        momentum (or read the stale buffer of an earlier turn) while the current one sits on its
        old home. So the home broadcasts it in the matrix's group; the new owner keeps it, every
        other rank drops its copy. Every rank plans alike, so all take part in the same moves.
        The broadcasts are counted in ``counter`` under MOMENTUM_MOVE."""
        self._resolve_homes(owners)
        entries, me = self._muon_entries(), dist.get_rank()
        moves = [(i, home, owners[i]) for i in owners if (home := self._replica_home[i]) != owners[i][1]]
        for i, home, (pg, owner, _) in moves:
            p = entries[i][1]
            if me in (home, owner):  # the home's buffer, or the new owner's (made now if it has none)
                self._broadcast_momentum(p, home, pg, counter)
            else:  # a rank between them receives too (a broadcast reaches the whole group)
                scratch = torch.empty_like(local_shard(p), dtype=self._offload.dtype(p, "momentum_buffer"))
                _count_broadcast(counter, scratch, home, pg)
                dist.broadcast(scratch, src=home, group=pg)
        for i, (_, owner, _) in owners.items():
            self._replica_home[i] = owner
            if me != owner:  # moved away, or a copy (init_state's zeros, a consolidation's): not kept
                self._drop_momentum(entries[i][1])

    def _spread_momentum(self, planned, counter: CommCounter) -> None:
        """Collective: replicated matrices that this plan orthogonalizes on every rank (strategy
        "redundant") need their momentum on every rank, and it lives on one home since an earlier
        step's owner path: the home broadcasts it, and every rank holds it from now on."""
        entries = self._muon_entries()
        for i, spec in planned.specs.items():
            if spec.layout != "replicated" or i in planned.owners or i not in self._replica_home:
                continue
            self._broadcast_momentum(entries[i][1], self._replica_home.pop(i), planned.groups[spec.group][0],
                                     counter)

    def _broadcast_momentum(self, p: torch.Tensor, src: int, group, counter: CommCounter) -> None:
        """Rank ``src``'s momentum of ``p`` into this rank's own buffer (made if it has none), over
        ``group``, through its store (a collective backend may need it on the device)."""
        for _, (buf,) in self._offload.each([(0, p, self._state_for(p, "muon"))], ("momentum_buffer",)):
            _count_broadcast(counter, buf, src, group)
            dist.broadcast(buf, src=src, group=group)

    def _drop_momentum(self, p: torch.Tensor) -> None:
        """Drop p's momentum here; an update rule's state stays (every replica keeps its own,
        see muonlab.optim.rule_step)."""
        state = self.state.get(p)
        if state is not None:
            state.pop("momentum_buffer", None)
            if not state:
                self.state.pop(p, None)

    def consolidate_state(self) -> None:
        """Collective (call on every rank): each replicated matrix's momentum is broadcast from
        the rank holding it, so that every rank holds every state tensor, e.g. before saving a
        checkpoint."""
        self.drop_captured_step()  # momentum made and moved between ranks: capture again
        owned = self._owned()  # first: the zeros init_state makes must not read as momentum held
        self.init_state()
        items = [(k, p, self.state[p]) for k, (_, p, _, _) in enumerate(owned)]
        # through the store: a collective backend may need the buffer on the parameter's device
        for k, (buf,) in self._offload.each(items, ("momentum_buffer",)):
            _, _, pg, home = owned[k]
            dist.broadcast(buf, src=home, group=pg)

    def release_unowned_state(self) -> None:
        """Drop the momentum of replicated matrices this rank does not hold for the group (after a
        save or a load): it lives on one rank only, a ZeRO-1 style saving. Collective only after a
        load (where it lies is asked then, ``_resolve_homes``)."""
        self.drop_captured_step()
        me = rank_or_zero()
        for i, p, _, home in self._owned():
            self._replica_home[i] = home
            if home != me:
                self._drop_momentum(p)
