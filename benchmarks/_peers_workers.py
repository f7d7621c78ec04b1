"""Worker functions for bench_peers.py (a module of its own so spawned workers import it).

Every optimizer gets its own copy of the same FSDP2-style Shard(0) DTensor parameters on a 1-D gloo
mesh and is stepped with the same DTensor grads; the peers (Dion's and XTuner's distributed Muon)
are imported from benchmarks/_peers/, where bench_peers.py copies them at a pinned commit. With
``replicas``, muonlab's kinds alone get plain tensors instead, equal on every rank (DDP replicas:
equal weights, bit-identical gradients).
"""

from __future__ import annotations

import contextlib
from collections import Counter
import math
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
import torch.distributed as dist

from muonlab import Muon
from muonlab.distributed import MeshAxis

from _rounds import balanced_orders
from _sets import small48_matrices

PEERS_DIR = Path(__file__).resolve().parent / "_peers"
LR, MOMENTUM, EPS = 0.02, 0.95, 1e-7
NORMUON_BETA2 = 0.95  # NorMuon's decay of its row second moments, both sides
KELLER = (3.4445, -4.7750, 2.0315)
D_MODEL, N_LAYERS = 256, 8
# one of a kind each (so a batch of same-shape matrices rarely fills the ranks), rows divisible by
# 4 because XTuner's FSDP2 Muon asserts even shards
ODD_SHAPES = [(512, 192), (192, 512), (320, 256), (256, 96)]


SETS = ("gpt", "small48")


def matrix_shapes(set_name: str = "gpt", d_model: int = D_MODEL,
                  n_layers: int = N_LAYERS) -> list[tuple[str, tuple[int, int]]]:
    """(name, global shape) of a set's matrices. "gpt": the hidden matrices of a width-``d_model``,
    ``n_layers``-layer GPT plus ODD_SHAPES (compute-bound); "small48": benchmarks/_sets.py's 48
    small matrices (host-bound; their rows, 24, 8 and 32, divide by 2 and 4 as XTuner requires)."""
    if set_name == "small48":
        return small48_matrices()
    if set_name != "gpt":
        raise ValueError(f"unknown matrix set {set_name!r}; expected one of {SETS}")
    per_layer = [("attn.qkv", (3 * d_model, d_model)), ("attn.proj", (d_model, d_model)),
                 ("mlp.fc", (4 * d_model, d_model)), ("mlp.out", (d_model, 4 * d_model))]
    gpt = [(f"blocks.{i}.{n}", s) for i in range(n_layers) for n, s in per_layer]
    return gpt + [(f"odd.{k}", s) for k, s in enumerate(ODD_SHAPES)]


def keller_ns(G: torch.Tensor, epsilon=EPS) -> torch.Tensor:
    """Keller Jordan's 5-step quintic Newton-Schulz in bf16 (batched over leading dims), the
    ``newton_schulz_func`` the peers get so all optimizers orthogonalize alike."""
    a, b, c = KELLER
    X = G.to(torch.bfloat16)
    tall = G.size(-2) > G.size(-1)
    if tall:
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + float(epsilon))
    for _ in range(5):
        A = X @ X.mT
        B = b * A + c * (A @ A)
        X = a * X + B @ X
    return X.mT if tall else X


# ------------------------------------------------------------------ byte counting at the collectives

_COUNTED = ("all_to_all_single", "all_to_all", "all_gather_into_tensor", "all_gather", "reduce_scatter_tensor",
            "reduce_scatter", "all_reduce", "broadcast", "scatter", "gather", "send", "recv", "isend", "irecv",
            "all_gather_object", "broadcast_object_list", "barrier")
_NO_BYTES = ("all_gather_object", "broadcast_object_list", "barrier")  # calls; their bytes are not known here


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


def _bytes_of(name: str, args, kwargs, world: int, me: int) -> tuple[int, int]:
    """(sent, received) by this rank, its own chunk excluded: the convention of muonlab's counter."""
    if name in _NO_BYTES:
        return 0, 0
    if name == "all_to_all_single":
        out, inp = args[0], args[1]
        out_splits = args[2] if len(args) > 2 else kwargs.get("output_split_sizes")
        in_splits = args[3] if len(args) > 3 else kwargs.get("input_split_sizes")
        row_out = _nbytes(out) // max(out.shape[0], 1) if out.dim() else out.element_size()
        row_in = _nbytes(inp) // max(inp.shape[0], 1) if inp.dim() else inp.element_size()
        sent = _nbytes(inp) - (in_splits[me] * row_in if in_splits else _nbytes(inp) // world)
        recv = _nbytes(out) - (out_splits[me] * row_out if out_splits else _nbytes(out) // world)
        return sent, recv
    if name == "all_to_all":
        outs, ins = args[0], args[1]
        return sum(map(_nbytes, ins)) - _nbytes(ins[me]), sum(map(_nbytes, outs)) - _nbytes(outs[me])
    if name == "all_gather_into_tensor":
        out, inp = args[0], args[1]
        return (world - 1) * _nbytes(inp), _nbytes(out) - _nbytes(inp)
    if name == "all_gather":
        outs, inp = args[0], args[1]
        return (world - 1) * _nbytes(inp), sum(map(_nbytes, outs)) - _nbytes(inp)
    if name == "reduce_scatter_tensor":
        out, inp = args[0], args[1]
        return _nbytes(inp) - _nbytes(out), (world - 1) * _nbytes(out)
    if name in ("all_reduce", "broadcast"):
        n = _nbytes(args[0])
        return 2 * (world - 1) * n // world, 2 * (world - 1) * n // world  # ring
    first = args[0] if args else next(iter(kwargs.values()))
    n = _nbytes(first) if torch.is_tensor(first) else sum(map(_nbytes, first or []))
    return n, n


@contextlib.contextmanager
def counting_collectives(tally: dict):
    """Wrap torch.distributed's collectives (looked up as dist.X at call time by the peers) and add
    each call's bytes to ``tally`` ("sent", "recv", "calls")."""
    world, me = dist.get_world_size(), dist.get_rank()
    saved = {name: getattr(dist, name) for name in _COUNTED}

    def wrap(name, fn):
        def counted(*args, **kwargs):
            sent, recv = _bytes_of(name, args, kwargs, world, me)
            tally["sent"] += sent
            tally["recv"] += recv
            tally["calls"] += 1
            return fn(*args, **kwargs)
        return counted

    for name, fn in saved.items():
        setattr(dist, name, wrap(name, fn))
    try:
        yield tally
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


@contextlib.contextmanager
def counting_process_group_ops(ops: Counter):
    """Count the process group's operations run inside the block, by kind ("all_to_all", ...):
    torch.profiler's ``gloo:<op>`` events, which every path to the process group records (the
    torch.distributed functions, DTensor's functional collectives, object collectives' inner
    gathers), where ``counting_collectives`` sees only the torch.distributed calls."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        yield ops
    ops.update(e.name.split(":", 1)[1] for e in prof.events() if e.name.startswith("gloo:"))


# ------------------------------------------------------------------ the optimizers


def _import_peer(name: str):
    """Dion's or XTuner's Muon class from benchmarks/_peers, or None when not there."""
    if str(PEERS_DIR) not in sys.path:
        sys.path.insert(0, str(PEERS_DIR))
    try:
        if name == "dion":
            from dion.muon import Muon as DionMuon
            return DionMuon
        if name == "dion-normuon":
            from dion.normuon import NorMuon as DionNorMuon
            return DionNorMuon
        from xtuner_muon.muon import Muon as XTunerMuon
        return XTunerMuon
    except ImportError as e:
        print(f"rank {dist.get_rank() if dist.is_initialized() else 0}: can't import peer {name}: {e}")
        return None


def build_optimizer(kind: str, params: list[tuple[str, torch.nn.Parameter]], mesh):
    """Same lr, momentum 0.95, Nesterov, 5 Keller steps in bf16, eps 1e-7, no weight decay, and the
    same lr adjustment: 0.2 sqrt(max(A, B)) (muonlab/torch "match_rms_adamw", the peers' "rms_norm").
    muonlab runs the plain iteration, as the peers and torch.optim.Muon do: the same FLOPs on every
    side (its default ``ns_form="auto"`` would take the gram form, with fewer). Its wire is bf16, as
    the peers' is (its default ``comm_dtype="auto"`` sends fp32 where Newton-Schulz runs in fp32)."""
    if kind.startswith("muonlab"):
        nonfinite = "ignore" if kind.endswith("ignore") else "skip"
        rule = dict(update_rule="normuon", normuon_beta2=NORMUON_BETA2) if kind.endswith("normuon") else {}
        decision = "device" if kind.endswith("device") else "host"
        return Muon(params, lr=LR, momentum=MOMENTUM, nesterov=True, weight_decay=0.0, eps=EPS,
                    adjust_lr="match_rms_adamw", nonfinite=nonfinite, nonfinite_decision=decision, ns_form="plain",
                    comm_dtype=torch.bfloat16, **rule)
    cls = _import_peer(kind)
    tensors = [p for _, p in params]
    kw = dict(lr=LR, mu=MOMENTUM, weight_decay=0.0, epsilon=EPS, nesterov=True, adjust_lr="rms_norm",
              newton_schulz_func=keller_ns)
    if kind.startswith("dion"):
        kw["use_polar_express"] = False
    if kind == "dion-normuon":
        kw["muon_beta2"] = NORMUON_BETA2
    return cls(tensors, distributed_mesh=mesh, **kw)


def _make_params(mesh, shapes, replicas: bool = False):
    from torch.distributed.tensor import Shard, distribute_tensor

    out = []
    for seed, (name, shape) in enumerate(shapes):
        full = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
        out.append((name, torch.nn.Parameter(full if replicas else distribute_tensor(full, mesh, [Shard(0)]))))
    return out


def _make_grads(mesh, shapes, step: int, replicas: bool = False):
    from torch.distributed.tensor import Shard, distribute_tensor

    fulls = [torch.randn(shape, generator=torch.Generator().manual_seed(1000 * step + seed))
             for seed, (_, shape) in enumerate(shapes)]
    return fulls if replicas else [distribute_tensor(full, mesh, [Shard(0)]) for full in fulls]


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full tensor; a plain tensor (a replica) as it is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _agreement(kinds: list[str], mesh, shapes, replicas: bool = False) -> dict[str, float]:
    """Max over matrices of ||U - U_torch|| / ||U_torch|| after two steps from the same start, U the
    whole-matrix update (X_before - X_after) / (lr * ratio) and U_torch torch.optim.Muon's."""
    steps = [_make_grads(mesh, shapes, s, replicas) for s in (0, 1)]

    def one_process_update(make) -> list[torch.Tensor]:
        ref = [torch.nn.Parameter(_whole(p).clone()) for _, p in _make_params(mesh, shapes)]
        ref_opt = make(ref)
        for grads in steps:
            before = [p.detach().clone() for p in ref]
            for p, g in zip(ref, grads):
                p.grad = _whole(g).clone()
            ref_opt.step()
        return [b - p.detach() for b, p in zip(before, ref)]

    muon_update = one_process_update(lambda ps: torch.optim.Muon(
        ps, lr=LR, momentum=MOMENTUM, nesterov=True, weight_decay=0.0, ns_coefficients=KELLER, eps=EPS, ns_steps=5,
        adjust_lr_fn="match_rms_adamw"))
    normuon_update = None  # NorMuon's one-process reference: muonlab's NorMuon on the whole matrices
    if any(k.endswith("normuon") for k in kinds):
        normuon_update = one_process_update(lambda ps: Muon(
            ps, lr=LR, momentum=MOMENTUM, nesterov=True, weight_decay=0.0, eps=EPS, adjust_lr="match_rms_adamw",
            ns_form="plain", update_rule="normuon", normuon_beta2=NORMUON_BETA2))
    out = {}
    for kind in kinds:
        ref_update = normuon_update if kind.endswith("normuon") else muon_update
        params = _make_params(mesh, shapes, replicas)
        opt = build_optimizer(kind, params, mesh)
        for grads in steps:
            before = [_whole(p.detach()).clone() for _, p in params]
            for (_, p), g in zip(params, grads):
                p.grad = g
            opt.step()
        errs = []
        for (_, p), b, u_ref, (_, shape) in zip(params, before, ref_update, shapes):
            u = b - _whole(p.detach())
            errs.append(float((u - u_ref).norm() / u_ref.norm()))  # noqa
        out[kind] = max(errs)
    return out


def _muonlab_stats(opt) -> dict:
    """What muonlab's last_step_stats() gives this benchmark, tolerant of keys that a later version
    drops or leaves None (the step's structure is changing): seconds per phase, the safety check's
    host seconds ("check", "wait"), bytes and calls counted by muonlab itself."""
    stats = opt.last_step_stats()
    nonfinite = stats.get("nonfinite_seconds") or {}
    seconds = stats.get("seconds")
    return dict(phases=seconds if isinstance(seconds, dict) else {},
                check=nonfinite.get("check", math.nan), wait=nonfinite.get("wait", math.nan),
                sent=sum((stats.get("bytes_sent") or {}).values()), recv=sum((stats.get("bytes_recv") or {}).values()),
                calls=sum((stats.get("calls") or {}).values()))


def _median(values: list[float]) -> float:
    finite = [v for v in values if not math.isnan(v)]
    return statistics.median(finite) if finite else math.nan


def peers_worker(kinds: list[str], rounds: int, warmup: int, set_name: str = "gpt", replicas: bool = False) -> dict:
    """Alternating rounds: each round steps every optimizer once, in balanced orders (each
    optimizer follows every other equally often), barrier to barrier. Before the timed rounds, one
    untimed step of every optimizer counts its collectives (bytes and torch.distributed calls at
    the call, process-group operations from torch.profiler). Returns per-optimizer step seconds
    per round, the counts, muonlab's phases. ``replicas``: plain tensors, muonlab's kinds only; the
    replicas' gradient fingerprint (muonlab.optim.replicas) is timed alone too."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    # the peers decorate their math with torch.compile(fullgraph=True): eager here. torch.compile
    # reads the variable when it decorates (at the peers' import); the flag alone makes fullgraph raise
    os.environ["TORCHDYNAMO_DISABLE"] = "1"
    torch._dynamo.config.disable = True
    world = dist.get_world_size()
    shapes = matrix_shapes(set_name)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=(MeshAxis.DP.value,))
    kinds = [k for k in kinds if k.startswith("muonlab") or (not replicas and _import_peer(k) is not None)]
    agreement = _agreement(kinds, mesh, shapes, replicas)
    params = {k: _make_params(mesh, shapes, replicas) for k in kinds}
    opts = {k: build_optimizer(k, params[k], mesh) for k in kinds}
    grads = _make_grads(mesh, shapes, 7, replicas)
    times = {k: [] for k in kinds}
    tally = {k: dict(sent=0, recv=0, calls=0) for k in kinds}
    ops = {k: Counter() for k in kinds}
    phases = {k: [] for k in kinds}
    check_s, wait_s = [], []  # muonlab's safety check inside its steps: the pass, and the control exchange
    orders = balanced_orders(len(kinds))

    def set_grads(k):
        for (_, p), g in zip(params[k], grads):
            p.grad = g

    for r in range(warmup):
        for i in orders[r % len(orders)]:
            set_grads(kinds[i])
            dist.barrier()
            opts[kinds[i]].step()
    for k in kinds:  # the counting step, untimed: the wrappers and the profiler cost host time
        set_grads(k)
        dist.barrier()
        with counting_collectives(tally[k]), counting_process_group_ops(ops[k]):
            opts[k].step()
        dist.barrier()
        if k.startswith("muonlab"):  # its matrix bytes from its own counter (control messages excluded)
            st = _muonlab_stats(opts[k])
            tally[k].update(sent=st["sent"], recv=st["recv"], muonlab_calls=st["calls"])
    for r in range(rounds):
        for i in orders[r % len(orders)]:
            k = kinds[i]
            set_grads(k)
            dist.barrier()
            t0 = time.perf_counter()
            opts[k].step()
            dist.barrier()  # the step is done when the slowest rank is done
            times[k].append(time.perf_counter() - t0)
            if k.startswith("muonlab"):
                st = _muonlab_stats(opts[k])
                if st["phases"]:
                    phases[k].append(st["phases"])
                if k == "muonlab":
                    check_s.append(st["check"])
                    wait_s.append(st["wait"])
    # the check it replaced, alone on the same grads: an isfinite per grad, then a blocking all-reduce
    before_s = []
    for _ in range(min(rounds, 50)):
        dist.barrier()
        t0 = time.perf_counter()
        bad = [i for i, g in enumerate(grads) if not torch.isfinite(_local(g)).all()]
        flags = torch.zeros(world)
        flags[dist.get_rank()] = float(bool(bad))
        dist.all_reduce(flags)
        before_s.append(time.perf_counter() - t0)
    fingerprint_s = []  # the replicas' gradient fingerprint alone, as a step takes it (read to the host)
    for _ in range(min(rounds, 50) if replicas else 0):
        from muonlab.optim.replicas import fingerprints

        t0 = time.perf_counter()
        fingerprints(grads).tolist()
        fingerprint_s.append(time.perf_counter() - t0)
    plan = {}
    if "muonlab" in opts:
        try:
            plan = dict(Counter(b.path for b in opts["muonlab"].plan()))
        except Exception as e:  # the plan's API may change under the optimizer's restructuring
            plan = {f"n/a ({type(e).__name__})": 0}
    median_phases = {k: {ph: statistics.median(s[ph] for s in v) for ph in v[0]} for k, v in phases.items() if v}
    return dict(kinds=kinds, times=times, bytes=tally, ops={k: dict(c) for k, c in ops.items()},
                agreement=agreement, phases=median_phases,
                start_s=_median(check_s), wait_s=_median(wait_s),
                before_s=statistics.median(before_s), plan=plan, world=world, set_name=set_name,
                fingerprint_s=_median(fingerprint_s))


def lower_bound_bytes(world: int, set_name: str = "gpt", itemsize: int = 2) -> float:
    """Sum over matrices of 2 (W-1)/W of its bytes in the wire dtype: gathered once, scattered once."""
    return sum(2 * (world - 1) / world * math.prod(s) * itemsize for _, s in matrix_shapes(set_name))
