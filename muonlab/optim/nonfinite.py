"""Is any gradient non-finite, on any rank? One fused check, its flag shared asynchronously.

``start`` runs one fused pass per (device, dtype) over the local gradients (torch's AMP
non-finite check with an inverse scale of 1.0: it rewrites each value as itself and raises a flag
on an inf or NaN), writes the flag into this rank's slot of a per-rank vector without a host sync,
and starts sharing the vector with every rank (``_share``) with ``async_op=True``. The caller does
work that commits nothing meanwhile and calls ``result()`` before it modifies anything (Muon: at
the engine's gate, after its first batches' momentum inputs (their buffers not yet written), way
out and Newton-Schulz; see muonlab.comm.engine).
Names of the culprits are looked for only when this rank's flag is up, so the common path does no
per-gradient work beyond grouping and the fused call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from ..comm.specs import local_shard


def _flag_into(found: torch.Tensor, grads: list[torch.Tensor], one: torch.Tensor) -> None:
    """Raise ``found`` (a one-element float tensor on the grads' device) if any grad is non-finite;
    ``one`` is the inverse scale 1.0 on that device."""
    try:
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found, one)
    except RuntimeError:
        # grads that can't be written in place (expanded views, inference tensors): no rewrite,
        # one reduction per grad and still no host sync
        found += torch.stack([torch.isfinite(g).all() for g in grads]).logical_not().any().float()


class NonfiniteCheck:
    """A started check: ``result()`` waits for the flags' exchange (if any) and reads them."""

    def __init__(self, grads: list[torch.Tensor], flags: torch.Tensor, me: int, work, group,
                 name_of: Callable[[int], str]):
        self._grads, self._flags, self._me, self._work = grads, flags, me, work
        self._group, self._name_of = group, name_of
        self._result: tuple[list[int], list[str]] | None = None

    def result(self) -> tuple[list[int], list[str]]:
        """(global ranks whose grads hold an inf or NaN, the same on every rank; names of this
        rank's non-finite grads). Without a group, this rank counts as rank 0."""
        if self._result is None:
            if self._work is not None:
                self._work.wait()
            bad = self._flags.cpu() > 0  # one host read, after the wait
            if self._group is None:
                ranks = [0] if bad[0] else []
            else:
                ranks = [dist.get_global_rank(self._group, r) for r in bad.nonzero().flatten().tolist()]
            names = []
            if bad[self._me]:
                names = [self._name_of(i) for i, g in enumerate(self._grads) if not torch.isfinite(g).all()]
            self._result = (ranks, names)
        return self._result


def _share(flags: torch.Tensor, me: int, size: int, group):
    """Start giving every rank of ``group`` every rank's slot of ``flags`` (each rank has written
    only its own): the work handle; ``flags`` holds them all once it completes.

    gloo: an all_to_all_single of one value to each rank, a single exchange with every peer. Its
    all-reduce passes the values rank to rank in several rounds, and with W processes sharing a
    few cores each round waits for a peer's thread to be scheduled: at W = 4 on 2 cores the flags
    were still in flight at the commit point (a 2 ms median wait; 0.1 ms with the exchange) and
    the step took about 1% longer (A/B runs in bench_peers.py's setting, 300 rounds). NCCL (and
    the rest): an all-reduce, logarithmic in W.
    """
    if dist.get_backend(group) == "gloo":
        return dist.all_to_all_single(flags, flags[me:me + 1].expand(size).contiguous(), group=group,
                                      async_op=True)
    return dist.all_reduce(flags, group=group, async_op=True)


def start(grads: Sequence[torch.Tensor], group=None, name_of: Callable[[int], str] | None = None) -> NonfiniteCheck:
    """Check ``grads`` (plain tensors or DTensors: their local shards) for infs and NaNs and start
    sharing the per-rank flags over ``group`` (None: no collective, a single rank).
    ``name_of(i)`` names the i-th grad in ``result()``'s list; it is called only for culprits."""
    local = [local_shard(g) for g in grads]
    by_device: dict[torch.device, dict[torch.dtype, list[torch.Tensor]]] = {}
    for g in local:
        by_device.setdefault(g.device, {}).setdefault(g.dtype, []).append(g)
    device = local[0].device if local else torch.device("cpu")  # NCCL wants the flags on the grads' device
    size = 1 if group is None else dist.get_world_size(group)
    me = 0 if group is None else dist.get_group_rank(group, dist.get_rank())
    flags = torch.zeros(size, dtype=torch.float32, device=device)
    mine = flags[me : me + 1]  # the check raises this rank's slot in place: no copy, no host sync
    for dev, by_dtype in by_device.items():
        found = mine if dev == device else torch.zeros(1, dtype=torch.float32, device=dev)
        one = torch.ones(1, dtype=torch.float32, device=dev)
        for gs in by_dtype.values():
            _flag_into(found, gs, one)
        if found is not mine:
            mine += found.to(device)
    work = None if group is None else _share(flags, me, size, group)
    if name_of is None:
        name_of = lambda i: f"grad {i} of shape {tuple(local[i].shape)}"  # noqa: E731
    return NonfiniteCheck(local, flags, me, work, group, name_of)
