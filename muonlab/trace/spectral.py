"""Spectral records of training: per matrix, every ``every`` optimizer steps, the top singular
value of the weight and of the applied update, the update's RMS and, for Muon matrices, how far
the Newton-Schulz output is from orthogonal.

``SpectralRecorder`` hangs on any torch optimizer through its step pre/post hooks: on a recording
step the pre-hook keeps a copy of the recorded weights, the post-hook takes the update as
``after - before`` (so it works for torch.optim.AdamW and torch.optim.Muon as well as muonlab's
Muon) and estimates top singular values. muonlab's Muon also hands the recorder each matrix's
Newton-Schulz output (``Muon._optimizer_spectral_observer``, called in its update stage).

Top singular values: power iteration on ``W^T W`` warm-started from the top vector of the last
recorded step, with the Lanczos refinement (the best value in the Krylov space of the iterates,
not the last iterate's; ``top_singular_values``): the same products ``W^T (W q)``, and on Muon's
nearly flat updates (singular values between about 0.7 and 1.2 times lr * ratio, where plain power
iteration needs tens of products) 6 give about 1% instead of 3-9%. The value is the top Ritz
value's root, never above sigma_max. Weights drift slowly, so after ``cold_iters`` (20) products
the first time a rank measures a weight ``warm_iters`` (3) keep the estimate close; updates change
direction between recorded steps, so each gets ``update_iters`` (6) (``exact_top_singular_value``
is the reference). Same-shape matrices run as one batched (bmm) chain.

The orthogonality error is ``||O O^T - I||_F / sqrt(m)`` with O oriented (m, n), m <= n: the root
mean square of (s_i^2 - 1) over O's m singular values. On the rank that ran the Newton-Schulz of a
whole matrix it is estimated from a fixed random sample of ``ortho_rows`` (64) rows of O O^T - I,
``sqrt(mean squared row norm)`` (its square is unbiased; exact for m <= 64), which costs 64 / m of
one Gram matmul. Row-sharded matrices (FSDP2) get it exactly from the Gram of the smaller side
(``||G||_F^2 - 2 tr(G) + m``, the same for either Gram), one matrix at a time and alike on every
rank: a tall matrix's ``O^T O`` is the sum over ranks of ``O_r^T O_r`` (all-reduced), a wide or
square one's ``O O^T`` needs all rows (all-gathered); in memory and bytes about the matrix's size.

Where it runs. A matrix is recorded by one rank, so records of all ranks concatenate
(``gather_spectral``). Plain tensors (one process, or DDP replicas): on the rank that ran the
matrix's Newton-Schulz when muonlab's Muon reported it, else (also when every rank ran it, as
with strategy "redundant") on rank ``position % world``, so the work is spread. FSDP2 matrices
(DTensors sharded on dim 0 of a 1-D mesh): every rank of the mesh computes on its rows; per
iteration one packed all-reduce of ``(W_r q)^T W_r`` for all such matrices, then one more for the
update RMS and which Newton-Schulz outputs were seen, then one collective per Muon matrix for its
Gram; rank ``position % mesh size`` keeps the record. The vectors are replicated and start from
the matrix name's seed, so a distributed run records what one process records.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from .._base import dist_on, local_shard

METRICS = ("weight_sigma", "update_sigma", "update_rms", "ortho_error")
"""The measured fields of a SpectralRecord, in the order notebooks show them."""
DERIVED = ("update_flatness",)
"""Values computed from the measured fields (SpectralRecord properties)."""


@dataclass
class SpectralRecord:
    """One matrix at one recorded step."""

    step: int
    """The step after which it was measured, counted by the recorder over the steps that completed
    (one that raised is not counted): 1 is the first it saw (a recorder attached after k steps
    labels the optimizer's step k + 1 as 1)."""
    name: str
    weight_sigma: float
    """Top singular value of the weight after the step."""
    update_sigma: float
    """Top singular value of the applied update (weight after minus before)."""
    update_rms: float
    """||update||_F / sqrt(numel)."""
    ortho_error: float = math.nan
    """||O O^T - I||_F / sqrt(m) of the Newton-Schulz output O (Muon matrices of muonlab's Muon only)."""
    rank: int = 0
    """The rank that recorded it."""
    shape: tuple[int, int] = (0, 0)
    """The matrix's global shape."""

    @property
    def update_flatness(self) -> float:
        """Stable rank of the update over its full rank, ||U||_F^2 / (sigma_max^2 min(shape)), in (0, 1]:
        1 when every singular value equals the top one (an orthogonal update), 1/min(shape) for rank 1."""
        numel, m = self.shape[0] * self.shape[1], min(self.shape)
        if not self.update_sigma > 0 or m == 0:
            return math.nan
        return numel * self.update_rms ** 2 / (self.update_sigma ** 2 * m)


# ---------------------------------------------------------------------------------- the math


def exact_top_singular_value(mat: torch.Tensor) -> torch.Tensor:
    """The reference: sigma_max of a matrix (or of each of a stack), by SVD, in fp64."""
    return torch.linalg.matrix_norm(mat.double(), ord=2)


def exact_ortho_error(o: torch.Tensor) -> torch.Tensor:
    """The reference: ||O O^T - I||_F / sqrt(m), O oriented so that O O^T is m x m, m the smaller dim."""
    o = o.double()
    if o.shape[-2] > o.shape[-1]:
        o = o.mT
    m = o.shape[-2]
    eye = torch.eye(m, dtype=o.dtype, device=o.device)
    return torch.linalg.matrix_norm(o @ o.mT - eye) / math.sqrt(m)


def _wide(t: torch.Tensor) -> torch.Tensor:
    """``t`` in fp32, or in its own dtype if wider (fp64): an update of 1e-7 on an fp64 weight of 1
    would otherwise be differenced in fp32, off by a percent."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def gram(o: torch.Tensor) -> torch.Tensor:
    """The smaller Gram matrix of O (or of each of a stack), in fp32 or wider."""
    o = _wide(o)
    return o @ o.mT if o.shape[-2] <= o.shape[-1] else o.mT @ o


def ortho_error_from_gram(g: torch.Tensor, m: int) -> torch.Tensor:
    """||O O^T - I||_F / sqrt(m) from a Gram matrix G of O (either one: both have O's squared
    singular values as nonzero eigenvalues): ||G||_F^2 - 2 tr(G) + m = sum (s_i^2 - 1)^2."""
    g = g.double()
    sq = g.square().sum((-2, -1)) - 2 * g.diagonal(dim1=-2, dim2=-1).sum(-1) + m
    return sq.clamp_min(0).sqrt() / math.sqrt(m)


def sampled_ortho_error(o: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """||O O^T - I||_F / sqrt(m) estimated from the rows ``rows`` of O O^T - I (O oriented m x n):
    sqrt(mean over them of a row's squared norm), unbiased in its square; exact (from the Gram)
    when ``rows`` is None. Costs len(rows) / m of the Gram's matmul."""
    o = _wide(o)
    if o.shape[-2] > o.shape[-1]:
        o = o.mT
    m = o.shape[-2]
    if rows is None:
        return ortho_error_from_gram(o @ o.mT, m)
    block = (o[rows] @ o.mT).double()  # (s, m): the sampled rows of O O^T
    block[torch.arange(len(rows)), rows] -= 1
    return (block.square().sum() / len(rows)).sqrt()


def top_singular_values(mats: list[torch.Tensor], vecs: list[torch.Tensor], iters: list[int],
                        all_reduce=None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Top singular value of each matrix of each (B, m, n) stack, and the new (B, n) unit vectors.

    Lanczos on ``W^T W`` started from ``vecs`` (the power iteration's Krylov space, with the best
    value in it rather than the last iterate's), ``iters[i]`` products for stack i, each new
    vector orthogonalised against all before it. Every product ``u^T W`` (``u = W q``) of every
    stack still iterating is packed in one buffer handed to ``all_reduce`` (in place; None for
    whole matrices, a sum over ranks for row shards); the rest is computed alike on every rank.
    At a breakdown (the vectors so far span an invariant subspace, e.g. a start vector in W's
    null space) the next vector is a fixed random one orthogonalised against them, starting a
    new Krylov block (beta 0). The value is the top Ritz value's root: never above sigma_max. A
    stack with nothing to follow (a zero matrix) keeps its vector, with the value 0. Products run
    in the stacks' dtype, unscaled: in fp32, entries past about 1e18 overflow W^T W q (NaN) and
    below about 1e-18 lose digits (scaling each matrix first would cost row shards a collective
    per recorded step).
    """
    basis = [[v] for v in vecs]  # orthonormal Krylov vectors per stack
    alphas: list[list[torch.Tensor]] = [[] for _ in mats]
    betas: list[list[torch.Tensor]] = [[] for _ in mats]
    largest = [torch.zeros(v.shape[0], dtype=v.dtype, device=v.device) for v in vecs]  # max |alpha| so far
    # restart vectors from CPU generators seeded by stack index: the same on every rank (row shards
    # all-reduce the products of the vectors they pick), and drawn up front, one copy per stack
    fresh = [torch.randn(max(k - 1, 0), v.shape[-1], generator=torch.Generator().manual_seed(i),
                         dtype=torch.float32).to(v.device, v.dtype) for i, (v, k) in enumerate(zip(vecs, iters))]
    for j in range(max(iters, default=0)):
        live = [i for i, k in enumerate(iters) if j < k]
        products = [torch.bmm(torch.bmm(mats[i], basis[i][-1].unsqueeze(-1)).mT, mats[i]).squeeze(1) for i in live]
        if all_reduce is not None:
            packed = torch.cat([w.reshape(-1) for w in products])
            all_reduce(packed)
            products = list(packed.split([w.numel() for w in products]))
            products = [w.view(vecs[i].shape) for i, w in zip(live, products)]
        for i, w in zip(live, products):
            q = torch.stack(basis[i], 1)  # (B, j+1, n)
            alphas[i].append((w * basis[i][-1]).sum(1))
            largest[i] = torch.maximum(largest[i], alphas[i][-1].abs())
            if j + 1 < iters[i]:
                w = _orthogonalised(w, q)
                beta = w.norm(dim=1)
                # relative to the largest |alpha| so far: alpha_0 is 0 for a start vector in W's null space
                broke = beta <= 1e-6 * largest[i]
                if j + 1 < q.shape[-1]:
                    restart = _orthogonalised(fresh[i][j].expand_as(w), q)
                    restart = restart / restart.norm(dim=1, keepdim=True).clamp_min(1e-30)
                else:  # the basis spans the whole space: zero vectors add eigenvalues 0 to T, no others
                    restart = torch.zeros_like(w)
                betas[i].append(torch.where(broke, torch.zeros_like(beta), beta))
                basis[i].append(torch.where(broke.unsqueeze(1), restart, w / beta.clamp_min(1e-30).unsqueeze(1)))
    sigmas, out = [], []
    for i, v in enumerate(vecs):
        if not alphas[i]:
            sigmas.append(torch.zeros(v.shape[0], device=v.device))
            out.append(v)
            continue
        t = torch.diag_embed(torch.stack(alphas[i], 1))
        if betas[i]:
            b = torch.stack(betas[i], 1)
            t = t + torch.diag_embed(b, 1) + torch.diag_embed(b, -1)
        t = t.double()
        # a matrix with inf or NaN (a diverged run) has no spectrum: NaN, where eigh would raise
        broken = ~torch.isfinite(t).all(dim=2).all(dim=1)
        values, vectors = torch.linalg.eigh(torch.where(broken[:, None, None], torch.zeros_like(t), t))
        ritz = torch.bmm(vectors[:, :, -1:].mT.to(v.dtype), torch.stack(basis[i], 1)).squeeze(1)
        norm = ritz.norm(dim=1, keepdim=True)
        top = values[:, -1].clamp_min(0).sqrt()
        sigmas.append(torch.where(broken, torch.full_like(top, math.nan), top).to(v.dtype))
        # a top Ritz value of 0 (a zero matrix) has no direction: its eigenvector may be a restart vector
        found = (values[:, -1:] > 0) & (norm > 0) & ~broken.unsqueeze(1)
        out.append(torch.where(found, ritz / norm.clamp_min(1e-30), v))
    return sigmas, out


def _orthogonalised(w: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Each row of ``w`` (B, n) minus its projection on the orthonormal rows of ``q`` (B, k, n), twice
    (once leaves rounding errors of the removed parts in fp32)."""
    for _ in range(2):
        w = w - torch.bmm(torch.bmm(w.unsqueeze(1), q.mT), q).squeeze(1)
    return w


# ---------------------------------------------------------------------------------- the recorder


def _row_sharded_group(p: torch.Tensor, name: str):
    """The process group a DTensor's rows are split over, or None for a plain tensor."""
    if not hasattr(p, "placements"):
        return None
    placements = tuple(p.placements)
    if p.device_mesh.ndim != 1 or len(placements) != 1 or not (
            placements[0].is_shard() and placements[0].dim == 0):
        raise ValueError(f"spectral records need parameter '{name}' whole or sharded on dim 0 of a 1-D mesh "
                         f"(FSDP2); it has placements {placements} on a {p.device_mesh.ndim}-D mesh")
    return p.device_mesh.get_group()


def _generator(seed: int, key: str) -> torch.Generator:
    """A CPU generator seeded from ``seed`` and ``key``: the same on every rank and in every run."""
    return torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(key.encode()))


def _initial_vector(name: str, n: int, seed: int) -> torch.Tensor:
    """A unit vector from the matrix name's seed."""
    v = torch.randn(n, generator=_generator(seed, name), dtype=torch.float32)
    return v / v.norm()


class SpectralRecorder:
    """Records spectral metrics of ``optimizer``'s matrices every ``every`` steps (see the module doc).

    ``named_parameters``: (name, tensor) pairs or a module (its ``named_parameters()``); ``names``:
    which to record (default: every 2-D one the optimizer holds). ``cold_iters``/``warm_iters``:
    products (iterations) for the weights at the first recorded step / later ones; ``update_iters``:
    for the updates at every recorded step (an update's top direction changes between recorded steps,
    so warm starts help it little). ``ortho_rows``: rows of O O^T - I sampled for the orthogonality
    error of a whole matrix. Attaches on construction (one recorder per muonlab Muon); ``detach()``
    removes the hooks. ``records`` grows by one SpectralRecord per recorded matrix and step.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, named_parameters, *, every: int,
                 names: Iterable[str] | None = None, cold_iters: int = 20, warm_iters: int = 3,
                 update_iters: int = 6, ortho_rows: int = 64, seed: int = 0):
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be an integer >= 1 (record every k-th step), got {every!r}")
        for option, value in (("cold_iters", cold_iters), ("warm_iters", warm_iters), ("update_iters", update_iters)):
            # one product only measures the start vector (its Rayleigh quotient) and never moves it
            if isinstance(value, bool) or not isinstance(value, int) or value < 2:
                raise ValueError(f"{option} must be an integer >= 2, got {value!r}")
        if isinstance(ortho_rows, bool) or not isinstance(ortho_rows, int) or ortho_rows < 1:
            raise ValueError(f"ortho_rows must be an integer >= 1, got {ortho_rows!r}")
        if isinstance(named_parameters, torch.nn.Module):
            named_parameters = named_parameters.named_parameters()
        by_name = dict(named_parameters)
        in_optimizer = {id(p) for g in optimizer.param_groups for p in g["params"]}
        if names is None:
            names = [n for n, p in by_name.items() if p.ndim == 2 and p.numel() and id(p) in in_optimizer]
        if isinstance(names, str):
            raise TypeError(f"names must be a list of parameter names, e.g. [{names!r}], not a str")
        names = list(names)
        if len(set(names)) != len(names):
            raise ValueError(f"names lists a parameter twice: {sorted(n for n in set(names) if names.count(n) > 1)}")
        unknown = [n for n in names if n not in by_name]
        if unknown:
            raise ValueError(f"unknown parameter name(s) {unknown} for spectral records; known: {sorted(by_name)}")
        for n in names:
            p = by_name[n]
            if p.ndim != 2 or not p.numel():
                raise ValueError(f"spectral records need non-empty 2-D matrices; parameter '{n}' has shape "
                                 f"{tuple(p.shape)}")
            if id(p) not in in_optimizer:
                raise ValueError(f"parameter '{n}' is not in the optimizer's parameter groups")
        self._world, self._rank = (dist.get_world_size(), dist.get_rank()) if dist_on() else (1, 0)
        self._groups = {n: _row_sharded_group(by_name[n], n) for n in names}  # raises on other layouts
        self.optimizer, self.every, self.seed = optimizer, every, seed
        self.cold_iters, self.warm_iters, self.update_iters = cold_iters, warm_iters, update_iters
        self.ortho_rows = ortho_rows
        self.names = names
        self._params = {n: by_name[n] for n in names}
        self._position = {n: i for i, n in enumerate(names)}
        muon_ids = {id(p) for g in optimizer.param_groups if g.get("algorithm") == "muon" for p in g["params"]}
        fused = getattr(optimizer, "fused_banks", {}) or {}
        # a fused bank is several matrices stacked: the Gram of the whole stack says nothing of each
        self._ortho_names = {id(by_name[n]): n for n in names if id(by_name[n]) in muon_ids and fused.get(n, 1) == 1}
        self._reports_ns = hasattr(type(optimizer), "_optimizer_spectral_observer")
        if self._reports_ns and getattr(optimizer, "_optimizer_spectral_recorder", None) is not None:
            # Muon hands its Newton-Schulz outputs to one observer
            raise ValueError("this Muon already has a SpectralRecorder attached; detach() it first")
        self.records: list[SpectralRecord] = []
        self._vectors: dict[tuple[str, str], torch.Tensor] = {}  # (name, "weight" | "update") -> unit vector
        self._steps = 0  # completed steps: a step that raised runs no post-hook and is not counted
        self._before: dict[str, torch.Tensor] | None = None
        self._rows: dict[str, torch.Tensor] = {}  # sharded: name -> this rank's rows of O (a copy)
        # whole: name -> orthogonality error, a 0-d tensor (read with the step's other values, no sync here)
        self._errors: dict[str, torch.Tensor] = {}
        self._samples: dict[str, torch.Tensor] = {}
        self._ns_owner: dict[str, bool] = {}
        self._handles = [optimizer.register_step_pre_hook(self._pre_step),
                         optimizer.register_step_post_hook(self._post_step)]
        if self._reports_ns:
            optimizer._optimizer_spectral_recorder = self  # named like torch's hooks: copies drop it

    def detach(self) -> None:
        """Remove the hooks (records stay)."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self._clear()
        if getattr(self.optimizer, "_optimizer_spectral_recorder", None) is self:
            self.optimizer._optimizer_spectral_recorder = None

    # ---------------------------------------------------------------- hooks

    def _pre_step(self, optimizer, args, kwargs) -> None:
        self._clear()  # what a step that raised left behind
        if (self._steps + 1) % self.every:
            return
        self._before = {n: _wide(local_shard(p).detach()).clone() for n, p in self._params.items()}
        if self._reports_ns and self._ortho_names:
            self.optimizer._optimizer_spectral_observer = self.observe_newton_schulz

    def _clear(self) -> None:
        """Drop the step's copies and stop observing."""
        self._before, self._rows, self._errors, self._ns_owner = None, {}, {}, {}
        self._stop_observing()

    def _stop_observing(self) -> None:
        if self._reports_ns and getattr(self.optimizer, "_optimizer_spectral_observer", None) is not None:
            self.optimizer._optimizer_spectral_observer = None

    def observe_newton_schulz(self, param: torch.Tensor, output: torch.Tensor, owned: bool | None) -> None:
        """Called by muonlab's Muon on a recording step with a matrix's Newton-Schulz output as
        this rank holds it (whole, or its rows for a sharded matrix) before it is applied;
        ``owned``: this rank ran its Newton-Schulz (False for a replica computed elsewhere), None
        for a replica every rank computed (no owner): then rank ``position % world`` records it."""
        name = self._ortho_names.get(id(param))
        if name is None:
            return
        if owned is None:
            owned = self._position[name] % self._world == self._rank
        self._ns_owner[name] = owned
        if not owned:
            return
        shape = tuple(param.shape)
        o = output.reshape(-1, shape[1]) if output.numel() else output.new_zeros(0, shape[1])
        if self._groups[name] is None:
            self._errors[name] = sampled_ortho_error(o, self._ortho_rows(name, min(shape)))
        else:  # a copy: Muon may reuse the output's buffer; the Gram waits for the other ranks' rows
            self._rows[name] = o.to(self._rows_dtype(name), copy=True)

    def _ortho_rows(self, name: str, m: int) -> torch.Tensor | None:
        """The fixed sample of rows (of O oriented m x n) for ``name``'s error; None: all m rows."""
        if m <= self.ortho_rows:
            return None
        if name not in self._samples:
            gen = _generator(self.seed, f"rows:{name}")
            self._samples[name] = torch.randperm(m, generator=gen)[:self.ortho_rows].sort().values
        return self._samples[name]

    def _post_step(self, optimizer, args, kwargs) -> None:
        self._steps += 1
        if self._before is None:
            return
        before, step = self._before, self._steps
        whole = [n for n in self.names if self._groups[n] is None and self._records_here(n)]
        sharded: dict = {}
        for n in self.names:
            if self._groups[n] is not None:
                sharded.setdefault(self._groups[n], []).append(n)
        results: dict[str, dict] = {}
        self._measure(whole, before, None, results)
        for group, members in sharded.items():
            self._measure(members, before, group, results)
        for n in self.names:
            if n in results and self._keeps_record(n):
                self.records.append(SpectralRecord(step=step, name=n, rank=self._rank,
                                                   shape=tuple(self._params[n].shape), **results[n]))
        self._clear()  # the step's copies are spent

    # ---------------------------------------------------------------- where

    def _records_here(self, name: str) -> bool:
        """Whether this rank measures a plain (whole) matrix: the rank that ran its Newton-Schulz
        if Muon said which (rank position % world where every rank ran it), else rank position % world."""
        if name in self._ns_owner:
            return self._ns_owner[name]
        return self._position[name] % self._world == self._rank

    def _keeps_record(self, name: str) -> bool:
        group = self._groups[name]
        if group is None:
            return True  # measured here only where it is recorded
        return self._position[name] % dist.get_world_size(group) == dist.get_rank(group)

    # ---------------------------------------------------------------- measuring

    def _measure(self, names: list[str], before: dict, group, results: dict) -> None:
        """Weight and update metrics of ``names`` (all whole, or all row-sharded over ``group``)."""
        if not names:
            return
        by_stack: dict[tuple, list[str]] = {}
        for n in names:
            # by GLOBAL shape: the same stacks, packed in the same order, on every rank (a rank's
            # rows of two matrices of one global shape have one local shape; uneven shards don't);
            # and by whether this rank holds the weight's vector: one it never measured (the first
            # recorded step, or the recording rank of a replica moved) needs cold_iters. Every rank
            # measures every row-sharded matrix at every recorded step, so all hold the same
            # vectors and agree on the stacks and the number of reductions.
            cold = (n, "weight") not in self._vectors
            by_stack.setdefault((tuple(self._params[n].shape), cold), []).append(n)
        stacks = list(by_stack.values())
        iters = [self.cold_iters if cold else self.warm_iters for _, cold in by_stack]
        weights = [torch.stack([_wide(local_shard(self._params[n]).detach()) for n in ns]) for ns in stacks]
        updates = [w - torch.stack([before[n] for n in ns]) for w, ns in zip(weights, stacks)]
        vecs = [self._vector_stack(ns, kind, w.shape[-1], w.device).to(w.dtype)
                for kind, mats in (("weight", weights), ("update", updates)) for ns, w in zip(stacks, mats)]
        all_reduce = None if group is None else (lambda t: dist.all_reduce(t, group=group))
        k = len(stacks)
        # weights and updates together, one reduction per product while any stack iterates
        sigmas, vecs = top_singular_values(weights + updates, vecs, iters + [self.update_iters] * k, all_reduce)
        for kind, offset in (("weight", 0), ("update", k)):
            for ns, v in zip(stacks, vecs[offset:offset + k]):
                for i, n in enumerate(ns):
                    self._vectors[(n, kind)] = v[i]
        # one more packed reduction: squared update norms, then per Muon matrix a flag (its
        # Newton-Schulz output was seen), so that every rank knows which errors to compute
        sq = torch.cat([u.square().sum((1, 2)) for u in updates]).double()
        flat_names = [n for ns in stacks for n in ns]
        ortho = [n for n in flat_names if n in self._ortho_names.values()] if group is not None else []
        packed = torch.cat([sq, sq.new_tensor([float(n in self._rows) for n in ortho])])
        if group is not None:
            dist.all_reduce(packed, group=group)
        sums = packed.tolist()
        errors = dict(self._errors) if group is None else {}
        for n, seen in zip(ortho, sums[len(flat_names):]):
            if seen > 0:
                errors[n] = self._sharded_ortho_error(n, group)
        errors = dict(zip(errors, torch.stack([e.double() for e in errors.values()]).tolist())) if errors else {}
        sigma_w, sigma_u = torch.cat(sigmas[:k]).tolist(), torch.cat(sigmas[k:]).tolist()
        for i, n in enumerate(flat_names):
            results[n] = dict(weight_sigma=sigma_w[i], update_sigma=sigma_u[i],
                              update_rms=math.sqrt(sums[i] / self._params[n].numel()),
                              ortho_error=errors.get(n, math.nan))

    def _sharded_ortho_error(self, name: str, group) -> torch.Tensor:
        """The exact orthogonality error of a row-sharded Muon matrix O (m x n), the same on every
        rank, from the Gram of its smaller side: for m > n, O^T O = sum over ranks of O_r^T O_r,
        all-reduced (n x n); else O O^T (m x m) from all rows, gathered (the matrix's own size).
        One matrix at a time, so the memory is at most one matrix (or its Gram) over the shards."""
        m, n = self._params[name].shape
        rows = self._rows.get(name)
        if rows is None:  # this rank saw no output: it adds nothing
            rows = torch.zeros(0, n, dtype=self._rows_dtype(name), device=local_shard(self._params[name]).device)
        if m > n:
            g = (rows.mT @ rows).double()
            dist.all_reduce(g, group=group)
        else:
            world = dist.get_world_size(group)
            per_rank = -(-m // world)  # FSDP2's rows per rank (torch.chunk); trailing ranks may hold fewer
            assert rows.shape[0] <= per_rank, (name, tuple(rows.shape), per_rank)
            # zero rows pad every rank's share to one size; they add nothing to ||G||_F^2 or tr(G)
            share = torch.cat([rows, rows.new_zeros(per_rank - rows.shape[0], n)])
            full = rows.new_empty(world * per_rank, n)
            dist.all_gather_into_tensor(full, share, group=group)
            g = full @ full.mT
        return ortho_error_from_gram(g, min(m, n))

    def _rows_dtype(self, name: str) -> torch.dtype:
        """fp32, or the parameter's dtype if wider: from global metadata, so that every rank
        gathers rows of one dtype, even one that saw no output."""
        return torch.promote_types(self._params[name].dtype, torch.float32)

    def _vector_stack(self, names: list[str], kind: str, n: int, device) -> torch.Tensor:
        return torch.stack([self._vectors[(m, kind)] if (m, kind) in self._vectors
                            else _initial_vector(f"{kind}:{m}", n, self.seed).to(device) for m in names])


def gather_spectral(records: list[SpectralRecord], group=None, dst: int = 0) -> list[SpectralRecord] | None:
    """All ranks' records on ``dst`` (None elsewhere), sorted by step then name; the local list
    when not distributed."""
    if not dist_on() or dist.get_world_size(group) == 1:
        return sorted(records, key=lambda r: (r.step, r.name))
    rows = [asdict(r) for r in records]
    out = [None] * dist.get_world_size(group) if dist.get_rank() == dst else None
    dist.gather_object(rows, out, dst=dst, group=group)
    if out is None:
        return None
    return sorted((SpectralRecord(**dict(row, shape=tuple(row["shape"]))) for rank_rows in out for row in rank_rows),
                  key=lambda r: (r.step, r.name))


def records_by_name(records: list[SpectralRecord], metric: str) -> dict[str, tuple[list[int], list[float]]]:
    """{matrix name: (steps, values of ``metric``)} (a measured or a DERIVED one), for plots."""
    if metric not in METRICS + DERIVED:
        raise ValueError(f"unknown spectral metric {metric!r}; choose one of {METRICS + DERIVED}")
    out: dict[str, tuple[list[int], list[float]]] = {}
    for r in sorted(records, key=lambda r: r.step):
        steps, values = out.setdefault(r.name, ([], []))
        steps.append(r.step)
        values.append(getattr(r, metric))
    return out
