"""Worker functions for the tensor-parallel tests (importable by spawned children).

A tiny MLP under torch's ColwiseParallel / RowwiseParallel on the "tp" axis of a 2 x 2 ("dp", "tp")
mesh, then ``fully_shard`` over "dp": its weights are DTensors with placements
``(_StridedShard(0), Shard(0))`` (column-wise) and ``(Shard(0), Shard(1))`` (row-wise), with uneven
and empty pieces. Each rank also steps a plain single-process copy on the same gradients, gathered
whole outside the step, so the comparison is of the optimizer alone.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from muonlab import Muon, muon_param_groups
from muonlab.comm.records import bytes_for_rank
from muonlab.comm.specs import local_shard, piece_numel

from ._common import SMALL_GPT, SMALL_MOE, build_gpt, build_moe_gpt, rank_rows, token_batches
from ._memory import memory_check

STEPS = 3
HYPER = dict(lr=0.05, weight_decay=0.01, momentum=0.9, ns_dtype=torch.float32, comm_dtype=torch.float32)
PAIRS = {  # column-wise layer -> the row-wise one after it: (in, hidden, out)
    "up": ("down", (6, 10, 6)),  # (10, 6) rows 5 + 5 per tp rank, then 3 + 2 per dp rank: uneven
    "sq_a": ("sq_b", (6, 6, 6)),  # two (6, 6) weights, one of each kind: one batch, two kinds of pieces
    "narrow_up": ("narrow_down", (6, 2, 6)),  # (2, 6): one row per tp rank, so dp rank 1 holds none
}


class TinyMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        for col, (row, (d_in, hidden, d_out)) in PAIRS.items():
            setattr(self, col, torch.nn.Linear(d_in, hidden, bias=False))
            setattr(self, row, torch.nn.Linear(hidden, d_out, bias=False))

    def forward(self, x):
        for col, (row, _) in PAIRS.items():
            x = getattr(self, row)(torch.relu(getattr(self, col)(x)))
        return x.square().mean()


def tp_plan() -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {}
    for col, (row, _) in PAIRS.items():
        plan[col], plan[row] = ColwiseParallel(), RowwiseParallel()
    return plan


def tp_model(replicate: int = 1):
    """(TinyMLP under TP x FSDP2 on a 2 x 2 mesh, its plain copy): both from seed 0. ``replicate``
    > 1: HSDP x TP on a (replicate, 2, 2) mesh, FSDP2 over ("replicate", "dp"): a column-wise
    weight's placements (Replicate(), _StridedShard(0), Shard(0))."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    torch.manual_seed(0)
    model = TinyMLP()
    plain = TinyMLP()
    plain.load_state_dict(model.state_dict())
    if replicate == 1:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        data = mesh["dp"]
    else:
        mesh = init_device_mesh("cpu", (replicate, 2, 2), mesh_dim_names=("replicate", "dp", "tp"))
        data = mesh["replicate", "dp"]
    parallelize_module(model, mesh["tp"], tp_plan())
    fully_shard(model, mesh=data)
    return model, plain


def inputs(step: int) -> torch.Tensor:
    return torch.randn(8, 6, generator=torch.Generator().manual_seed(100 + step))


class FullGatherCount:
    """Counts DTensor full gathers and redistributions (explicit, and implicit in a DTensor op)
    while active."""

    def __init__(self):
        import torch.distributed.tensor._api as api
        import torch.distributed.tensor._dispatch as dispatch
        from torch.distributed.tensor import DTensor

        self.calls = 0
        self._sites = [(DTensor, "full_tensor"), (DTensor, "redistribute"), (api, "redistribute_local_tensor"),
                       (dispatch, "redistribute_local_tensor")]
        self._saved = []

    def _counted(self, fn):
        def wrapper(*args, **kwargs):
            self.calls += 1
            return fn(*args, **kwargs)
        return wrapper

    def __enter__(self):
        for owner, name in self._sites:
            fn = getattr(owner, name)
            self._saved.append((owner, name, fn))
            setattr(owner, name, self._counted(fn))
        return self

    def __exit__(self, *exc):
        for owner, name, fn in self._saved:
            setattr(owner, name, fn)
        self._saved.clear()


def steps_beside_plain(opt, ref, params, plain, grad_of) -> tuple[list[int], dict[str, float]]:
    """``STEPS`` steps of ``opt`` on ``params`` (DTensors) and of ``ref`` on ``plain`` (their whole
    copies) from the same gradients (``grad_of(step, k, name)``: parameter k's whole gradient, laid
    out here as the parameter is). Returns the full gathers counted in each step after the first,
    and each parameter's largest error relative to its one-process value."""
    from torch.distributed.tensor import distribute_tensor

    gathers = []
    for step in range(STEPS):
        for k, ((name, p), (_, q)) in enumerate(zip(params, plain)):
            g = grad_of(step, k, name)
            p.grad, q.grad = distribute_tensor(g, p.device_mesh, p.placements), g
        with FullGatherCount() as count:
            opt.step()
        gathers.append(count.calls)
        ref.step()
    errors = {n: float((p.full_tensor() - q.detach()).abs().max() / q.detach().abs().max())
              for (n, p), (_, q) in zip(params, plain)}
    return gathers[1:], errors


def train_tp(rule: str, replicate: int = 1) -> dict:
    """3 steps of Muon with ``rule`` on the TP x FSDP2 MLP (``replicate``: HSDP x TP, see
    ``tp_model``) and on its plain copy, from the same gradients; the full gathers counted in the
    steps after the first."""
    torch.set_num_threads(1)
    model, plain = tp_model(replicate)
    opt = Muon(list(model.named_parameters()), update_rule=rule, **HYPER)
    ref = Muon(list(plain.named_parameters()), update_rule=rule, **HYPER)
    gathers = []
    for step in range(STEPS):
        model(inputs(step)).backward()
        for (_, p), q in zip(model.named_parameters(), plain.parameters()):
            q.grad = p.grad.full_tensor()  # outside the counted step
        with FullGatherCount() as count:
            opt.step()
        gathers.append(count.calls)
        ref.step()
        opt.zero_grad()
        ref.zero_grad()
    rank = dist.get_rank()
    plain_params = dict(plain.named_parameters())
    errors = {}
    for name, p in model.named_parameters():
        want = plain_params[name].detach()
        errors[name] = float((p.full_tensor() - want).abs().max() / want.abs().max())
    variances = {}
    if rule == "normuon":  # every row's second moment on every rank, as the one process has them
        for (name, p), q in zip(model.named_parameters(), plain.parameters()):
            want = ref.state[q]["row_variance"]
            variances[name] = float((local_shard(opt.state[p]["row_variance"]) - want).abs().max()
                                    / want.abs().max())
    stats = opt.last_step_stats()
    planned_sent, planned_recv = bytes_for_rank(opt.plan(), rank)
    # the rule's all-reduce as planned (a ring: 2 (W - 1) / W of its fp32 bytes, as counted)
    planned_rule = sum(2 * (b.group.size - 1) * 4 * b.rule_sums // b.group.size for b in opt.plan() if b.rule_sums)
    return dict(errors=errors, variances=variances, gathers=gathers[1:], sent=stats["bytes_sent"],
                placements={name: str(tuple(p.placements)) for name, p in model.named_parameters()},
                recv=stats["bytes_recv"], planned_sent=planned_sent, planned_recv=planned_recv,
                planned_rule=planned_rule, counted_rule=stats["bytes_sent"].get(rule, 0),
                plan=[(b.path, b.names, b.owners, b.bytes_sent, b.flops, b.travels_with) for b in opt.plan()],
                memory=memory_check(opt), owners_hold=all(piece_numel(pcs[o]) > 0 for b in opt.plan() for pcs, o in zip(b.pieces, b.owners)))


def pieces_match() -> dict:
    """Each weight's piece on this rank (the spec's, from global metadata) against the DTensor's
    own local tensor, read out of its ``full_tensor()``; and the piece's shape and first offset
    against torch's ``compute_local_shape_and_global_offset``."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from muonlab.comm.paths.pieces import piece_shape, take
    from muonlab.comm.specs import matrix_spec

    model, _ = tp_model()
    out = {}
    for i, (name, p) in enumerate(model.named_parameters()):
        spec = matrix_spec(i, name, p)
        me = spec.group.local_ranks()[dist.get_rank()]
        piece = spec.pieces[me]
        shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
        first = tuple(runs[0][0] if runs else None for runs in piece)
        local = p.to_local()
        out[name] = dict(placements=str(tuple(p.placements)), layout=spec.layout, shape=tuple(local.shape),
                         same_values=bool(torch.equal(take(p.full_tensor(), piece), local)),
                         same_shape=piece_shape(piece) == tuple(shape) == tuple(local.shape),
                         same_offset=all(f is None or f == o for f, o in zip(first, offset)))
    return out


def _step_counted(model, opt, batches) -> list[int]:
    """Full gathers in each step after the first."""
    counts = []
    for x in batches:
        model(x, x).backward()
        with FullGatherCount() as count:
            opt.step()
        opt.zero_grad()
        counts.append(count.calls)
    return counts[1:]


def layouts_gathers() -> dict:
    """Full gathers in the hot step (after a warm-up step) on each layout Muon claims."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from muonlab.distributed import build_mesh, parallelize

    torch.set_num_threads(1)
    world = dist.get_world_size()
    out = {}
    batches = [rank_rows(x) for x in token_batches(7, world, SMALL_GPT["context"], 2)]
    for mode in ("fsdp", "hsdp", "ddp"):
        mesh = build_mesh(replicate=2) if mode == "hsdp" else None
        model, inner, _ = parallelize(build_gpt(**SMALL_GPT), mode, mesh)
        opt = Muon(muon_param_groups(inner), **HYPER)
        out[mode] = dict(gathers=_step_counted(model, opt, batches), paths=sorted({b.path for b in opt.plan()}))
    moe_batches = [rank_rows(x) for x in token_batches(7, world, SMALL_MOE["context"], 2)]
    model, inner, _ = parallelize(build_moe_gpt(4, **SMALL_MOE), "ep", ep=2)
    opt = Muon(muon_param_groups(inner), **HYPER)
    out["ep"] = dict(gathers=_step_counted(model, opt, moe_batches), paths=sorted({b.path for b in opt.plan()}))
    # uneven and empty row shards (2, 2, 2, 0 and 3, 3, 3, 1 rows on 4 ranks), explicit
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    params = [(f"w{k}", torch.nn.Parameter(distribute_tensor(torch.randn(shape, generator=torch.Generator()
                                                                          .manual_seed(k)), mesh, [Shard(0)])))
              for k, shape in enumerate([(6, 10), (10, 7)])]
    opt = Muon(params, **HYPER)
    counts = []
    for step in range(2):
        for _, p in params:
            p.grad = distribute_tensor(torch.ones(p.shape) * (step + 1), mesh, [Shard(0)])
        with FullGatherCount() as count:
            opt.step()
        counts.append(count.calls)
    out["uneven"] = dict(gathers=counts[1:], paths=sorted({b.path for b in opt.plan()}),
                         shards=[tuple(p.to_local().shape) for _, p in params])
    return out


def rowwise_alone(rule: str) -> dict:
    """Muon with ``rule`` on a row-wise weight with no FSDP2: one Shard(1) on a 1-D mesh of 4 (6 columns: 2, 2, 2, 0) and
    beside a Replicate axis on the 2 x 2 mesh (7 columns: 4, 3), against one process over 3 steps
    from the same gradients; the paths, the full gathers in the hot steps, any warning."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    torch.set_num_threads(1)
    meshes = {"alone": init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",)),
              "replicated": init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))}
    kinds = {"alone": ((6, 6), [Shard(1)]), "replicated": ((5, 7), [Replicate(), Shard(1)])}

    def start(name):
        return torch.randn(kinds[name][0], generator=torch.Generator().manual_seed(len(name)))

    params = [(n, torch.nn.Parameter(distribute_tensor(start(n), meshes[n], kinds[n][1]))) for n in kinds]
    plain = [(n, torch.nn.Parameter(start(n))) for n in kinds]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt, ref = Muon(params, update_rule=rule, **HYPER), Muon(plain, update_rule=rule, **HYPER)
        gathers, errors = steps_beside_plain(opt, ref, params, plain, lambda step, k, n: torch.randn(
            kinds[n][0], generator=torch.Generator().manual_seed(10 * step + len(n))))
    if rule == "normuon":  # every row's second moment on every rank, as the one process has them
        for (n, p), (_, q) in zip(params, plain):
            want = ref.state[q]["row_variance"]
            errors[f"{n} row_variance"] = float((local_shard(opt.state[p]["row_variance"]) - want).abs().max()
                                                / want.abs().max())
    return dict(errors=errors, gathers=gathers, plan=[(b.path, b.names) for b in opt.plan()],
                warnings=[str(c.message) for c in caught if "gather" in str(c.message)])


def replicated_slices() -> dict:
    """HSDP x TP's shape on 4 ranks: a (replicate 2, dp 2, tp 1) mesh, weights sharded on dp and tp
    and replicated across the first axis, so each replica's flattened (dp, tp) group is its own
    process group ([0, 1] and [2, 3]); against one process, from the same gradients."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2, 1), mesh_dim_names=("rep", "dp", "tp"))
    kinds = {"col": (Replicate(), Shard(0), Shard(1)), "row": (Replicate(), Shard(1), Shard(0))}
    shapes = {"col": (5, 4), "row": (4, 5)}  # uneven: 3 + 2 on the dp axis

    def start(name):
        return torch.randn(shapes[name], generator=torch.Generator().manual_seed(len(name)))

    params = [(n, torch.nn.Parameter(distribute_tensor(start(n), mesh, pl))) for n, pl in kinds.items()]
    plain = [(n, torch.nn.Parameter(start(n))) for n in kinds]
    opt, ref = Muon(params, **HYPER), Muon(plain, **HYPER)
    _, errors = steps_beside_plain(opt, ref, params, plain, lambda step, k, n: torch.randn(
        shapes[n], generator=torch.Generator().manual_seed(10 * step + len(n))))
    (group,) = {b.group for b in opt.plan()}
    return dict(errors=errors, slices=group.axis_slices(), paths=sorted({b.path for b in opt.plan()}))


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)  # the same random weights on every rank
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=4,
                                        max_position_embeddings=16))


def _against_one_process(make, loss, batches, **parallel) -> dict:
    """``make()`` under ``parallelize(model, "fsdp+tp", **parallel)`` and a plain copy, each stepped
    by Muon on the same batches (fed to every rank): the relative displacement, the placements, the
    plan's paths."""
    from muonlab.distributed import parallelize

    from ._common import cloned, rel_displacement

    model, plain = make(), make()
    start = cloned(plain.named_parameters())
    model, inner, mesh = parallelize(model, "fsdp+tp", **parallel)
    opt, ref = Muon(muon_param_groups(inner), **HYPER), Muon(muon_param_groups(plain), **HYPER)
    for x in batches:
        for m, o in ((model, opt), (plain, ref)):
            loss(m, x).backward()
            o.step()
            o.zero_grad()
    got = {n: p.full_tensor().detach() for n, p in inner.named_parameters()}
    return dict(displacement=rel_displacement(got, cloned(plain.named_parameters()), start),
                placements={n: str(tuple(p.placements)) for n, p in inner.named_parameters()},
                paths=sorted({b.path for b in opt.plan()}), mesh=(tuple(mesh.mesh_dim_names), tuple(mesh.shape)))


def gpt_fsdp_tp() -> dict:
    """muonlab's GPT under ``parallelize(model, "fsdp+tp", mesh, tp_axis="tp")`` on a 2 x 2 mesh and
    a plain copy, each stepped by Muon on the same token batches (fed to every rank)."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    return _against_one_process(lambda: build_gpt(**SMALL_GPT), lambda m, x: m(x, x),
                                token_batches(9, 1, SMALL_GPT["context"], STEPS), mesh=mesh, tp_axis="tp")


def fsdp_tp_default_mesh() -> dict:
    """``parallelize(model, "fsdp+tp", tp=2)``: the mesh made by muonlab, on a tiny Hugging Face Llama
    (GQA: 4 query, 2 key/value heads) and muonlab's GPT; a model TP and FSDP2 already sharded passes as
    it is; the refusals that need a process group."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    from muonlab.distributed import build_mesh, parallelize
    from muonlab.distributed.parallelize import default_tp_plan

    torch.set_num_threads(1)
    batches = [torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(s)) for s in range(STEPS)]
    out = dict(llama=_against_one_process(_llama, lambda m, x: m(input_ids=x, labels=x).loss, batches, tp=2),
               gpt=_against_one_process(lambda: build_gpt(**SMALL_GPT), lambda m, x: m(x, x),
                                        token_batches(9, 1, SMALL_GPT["context"], STEPS), tp=2))
    # torchtitan's style: the caller applied TP and FSDP2; parallelize hands the model back as it is
    mesh = build_mesh(tp=2)
    model = _llama()
    parallelize_module(model, mesh["tp"], default_tp_plan(model, 2))
    fully_shard(model, mesh=mesh["dp"])
    before = {n: (str(tuple(p.placements)), p.to_local().clone()) for n, p in model.named_parameters()}
    again, inner, got_mesh = parallelize(model, "fsdp+tp")
    out["passed"] = dict(same=again is model and inner is model and all(
        str(tuple(p.placements)) == before[n][0] and torch.equal(p.to_local(), before[n][1])
        for n, p in model.named_parameters()), mesh=(tuple(got_mesh.mesh_dim_names), got_mesh.mesh.tolist()))
    errors = {}
    for what, call in (("tp=3", lambda: parallelize(_llama(), "fsdp+tp", tp=3)),
                       ("no plan", lambda: parallelize(torch.nn.Sequential(torch.nn.Linear(4, 4)), "fsdp+tp", tp=2)),
                       ("heads", lambda: parallelize(_llama(), "fsdp+tp", tp=4)),
                       ("again with tp", lambda: parallelize(model, "fsdp+tp", tp=2))):
        try:
            call()
            errors[what] = None
        except ValueError as e:
            errors[what] = str(e)
    out["errors"] = errors
    return out


def checkpoint_across_tp(folder: str) -> dict:
    """DCP across TP sizes: muonlab's GPT on (dp 2, tp 2) after 2 Muon steps saved, loaded on (dp 4,
    tp 1), saved again and loaded back on (dp 2, tp 2): every parameter and every Muon state tensor,
    read whole, equal bit for bit to the first model's at each load; one more step from each load
    equals the step the first model takes."""
    import os

    from muonlab import checkpoint
    from muonlab.distributed import parallelize

    torch.set_num_threads(1)
    batches = token_batches(11, 1, SMALL_GPT["context"], 3)

    def run(tp, steps=()):
        model, inner, _ = parallelize(build_gpt(**SMALL_GPT), "fsdp+tp", tp=tp)
        opt = Muon(muon_param_groups(inner), **HYPER)
        for x in steps:
            model(x, x).backward()
            opt.step()
            opt.zero_grad()
        return model, opt

    def whole(model, opt):
        out = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
        params = dict(model.named_parameters())
        for n, p in params.items():
            for key, t in opt.state.get(p, {}).items():
                if torch.is_tensor(t) and t.ndim:
                    out[f"{n}.{key}"] = t.full_tensor().clone() if hasattr(t, "full_tensor") else t.clone()
        return out

    def one_more(model, opt):
        model(batches[2], batches[2]).backward()
        opt.step()
        return {n: p.full_tensor().clone() for n, p in model.named_parameters()}

    first, first_opt = run(2, batches[:2])
    saved = whole(first, first_opt)
    checkpoint.save(os.path.join(folder, "tp2"), first, first_opt, step=2)
    wide, wide_opt = run(1)
    step_wide = checkpoint.load(os.path.join(folder, "tp2"), wide, wide_opt)
    on_wide = whole(wide, wide_opt)
    checkpoint.save(os.path.join(folder, "tp1"), wide, wide_opt, step=step_wide)
    back, back_opt = run(2)
    step_back = checkpoint.load(os.path.join(folder, "tp1"), back, back_opt)
    on_back = whole(back, back_opt)
    want = one_more(first, first_opt)

    def diffs(got):
        return {k: (None if k not in got else float((got[k] - v).abs().max()) if v.numel() else 0.0)
                for k, v in saved.items()}

    def step_diff(got):
        return max(float((got[n] - w).abs().max()) for n, w in want.items())

    return dict(steps=(step_wide, step_back), keys=len(saved), extra=sorted(set(on_wide) - set(saved)),
                wide=diffs(on_wide), back=diffs(on_back), state_keys=sorted({k.rsplit(".", 1)[-1] for k in saved if
                                                                             k.endswith(("momentum_buffer", "momentum"))}),
                placements={n: (str(tuple(p.placements)), str(tuple(q.placements))) for (n, p), (_, q) in
                            zip(first.named_parameters(), wide.named_parameters()) if "mlp" in n},
                next_wide=step_diff(one_more(wide, wide_opt)), next_back=step_diff(one_more(back, back_opt)))




def heads_under_tp(rule: str) -> dict:
    """Muon with ``rule`` and ``split_heads`` on the tiny Llama under ``parallelize(.., "fsdp+tp", tp=2)``
    and on its plain copy, from the same gradients (gathered whole outside the step), 3 steps: the
    errors per parameter, the plan (path, group axis, names, bytes) and the bytes counted."""
    from muonlab.distributed import parallelize

    torch.set_num_threads(1)
    model, plain = _llama(), _llama()
    model, inner, _ = parallelize(model, "fsdp+tp", tp=2)
    opt = Muon(muon_param_groups(inner, split_heads=True), update_rule=rule, **HYPER)
    ref = Muon(muon_param_groups(plain, split_heads=True), update_rule=rule, **HYPER)
    named = dict(inner.named_parameters())
    for step in range(STEPS):
        x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(step))
        model(input_ids=x, labels=x).loss.backward()
        for n, q in plain.named_parameters():
            q.grad = named[n].grad.full_tensor()
        opt.step()
        ref.step()
        opt.zero_grad()
        ref.zero_grad()
    errors = {}
    for n, q in plain.named_parameters():
        if n.endswith("proj.weight"):
            want = q.detach()
            errors[n] = float((named[n].full_tensor() - want).abs().max() / want.abs().max())
    stats = opt.last_step_stats()
    planned_sent, _ = bytes_for_rank(opt.plan(), dist.get_rank())
    return dict(errors=errors, sent=stats["bytes_sent"], planned_sent=planned_sent,
                plan=[(b.path, b.group.axis_name if b.group else None, b.names, b.num_matrices, b.matrix_shape,
                       sum(b.bytes_sent)) for b in opt.plan()])


QK_TAU = 27.0
"""Layer 0's heads read 43.6, 26.9, 27.5 and 28.6 on the first batch: heads on both TP ranks clipped,
head 1 not, in a clipped kv group (heads 0 and 1 share one)."""


def qk_clip_under_tp() -> dict:
    """QK-clip on the real-model tests' tiny Llama (4 heads, 2 kv heads of 8; q/k of layer 0 boosted)
    under ``parallelize(.., "fsdp+tp", tp=2)``, each dp rank its rows of the global batches (a TP group
    the same), against one process on the whole batches: one forward then ``apply()`` at ``QK_TAU`` (the max logit
    and gamma per head, every parameter whole after the clip); and 3 SGD steps with the clip attached
    (``_workers_qk_clip.single_process_hf``)."""
    from muonlab.distributed import parallelize
    from muonlab.optim.qk_clip import QKClip
    from tests.real_models._workers import rows

    from ._workers_qk_clip import HF_TAU, _records, _train_hf, build_llama, hf_batches, single_process_hf

    torch.set_num_threads(1)

    def relative(got: dict, want: dict) -> dict:
        return {n: float((got[n] - w).abs().max() / w.abs().max()) for n, w in want.items()}

    def flat(records):
        return [[g for layer in s["gamma"] for g in layer] for s in records]

    def logit_errors(got, want):
        return max(abs(a - b) / abs(b) for s, t in zip(got, want) for g, w in zip(s["max_logit"], t["max_logit"])
                   for a, b in zip(g, w))

    x = hf_batches(2)[0]
    plain = build_llama()
    one = QKClip(plain, tau=QK_TAU)
    plain(input_ids=x, labels=x)
    one.apply()
    model, inner, mesh = parallelize(build_llama(), "fsdp+tp", tp=2)
    dp = mesh.get_local_rank("dp")
    clip = QKClip(inner, tau=QK_TAU)
    with torch.no_grad():
        model(input_ids=rows(x, dp), labels=rows(x, dp))
    clip.apply()
    whole = {n: p.full_tensor().detach() for n, p in inner.named_parameters()}
    once = dict(errors=relative(whole, {n: p.detach() for n, p in plain.named_parameters()}),
                logit_error=logit_errors(_records(clip), _records(one)), gammas=flat(_records(clip)),
                want_gammas=flat(_records(one)))
    model, inner, mesh = parallelize(build_llama(), "fsdp+tp", tp=2)
    steps = _train_hf(model, [rows(b, dp) for b in hf_batches(2)], HF_TAU)
    want = single_process_hf(2)
    whole = {n: p.full_tensor().detach() for n, p in inner.named_parameters()}
    return dict(once=once, steps=dict(errors=relative(whole, want["params"]),
                                      logit_error=logit_errors(_records(steps), want["clip"]),
                                      gammas=flat(_records(steps)), want_gammas=flat(want["clip"])),
                q_placements=str(tuple(inner.model.layers[0].self_attn.q_proj.weight.placements)))


def everything(folder: str) -> dict:
    """All the checks of one 4-rank launch (``folder``: shared by the ranks, for the checkpoints)."""
    return dict(pieces=pieces_match(), muon=train_tp("muon"), normuon=train_tp("normuon"),
                layouts=layouts_gathers(), rowwise={rule: rowwise_alone(rule) for rule in ("muon", "normuon")}, replicated=replicated_slices(),
                gpt=gpt_fsdp_tp(), default_mesh=fsdp_tp_default_mesh(), checkpoint=checkpoint_across_tp(folder),
                heads={rule: heads_under_tp(rule) for rule in ("muon", "normuon")}, qk_clip=qk_clip_under_tp())


EXPERT_BANKS = {  # name -> (local experts, d_out, d_in), tensor-parallel dim, as Megatron splits an expert MLP
    "experts.w_in": ((3, 10, 6), 1),  # column-wise: d_out over tp; 3 experts over dp: 2 + 1
    "experts.w_out": ((3, 6, 10), 2),  # row-wise: d_in over tp
}


def ep_fsdp_tp(rule: str) -> dict:
    """EP x FSDP x TP on a (dp 2, ep 2, tp 2) mesh: each ep rank's own experts (a bank of 3, its
    values seeded by the ep rank, as ``apply_ep`` leaves them local), sharded over dp on the
    expert dim and over tp inside each expert: placements (Shard(0), Shard(1 or 2)) on the
    ("dp", "tp") sub-mesh, uneven over dp. Muon steps them from seeded gradients; each rank checks
    its ep slice against one process stepping that slice's banks whole; bytes as planned, no full
    gathers, and no owner holding none of what it owns."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp", "ep", "tp"))
    ep_rank, sub = mesh.get_local_rank("ep"), mesh["dp", "tp"]
    params, plain = [], []
    for k, (name, (shape, tp_dim)) in enumerate(EXPERT_BANKS.items()):
        whole = torch.randn(shape, generator=torch.Generator().manual_seed(10 * ep_rank + k))
        params.append((name, torch.nn.Parameter(distribute_tensor(whole, sub, [Shard(0), Shard(tp_dim)]))))
        plain.append((name, torch.nn.Parameter(whole.clone())))
    opt = Muon(params, update_rule=rule, **HYPER)
    alone, _ = dist.new_subgroups(group_size=1)  # the one process: each rank's experts are its own
    ref = Muon(plain, update_rule=rule, process_group=alone, **HYPER)
    gathers, errors = steps_beside_plain(opt, ref, params, plain, lambda step, k, n: torch.randn(
        EXPERT_BANKS[n][0], generator=torch.Generator().manual_seed(1000 * step + 10 * ep_rank + k)))
    stats, plan = opt.last_step_stats(), opt.plan()
    planned_sent, planned_recv = bytes_for_rank(plan, dist.get_rank())
    return dict(errors=errors, gathers=gathers, sent=stats["bytes_sent"], recv=stats["bytes_recv"],
                planned_sent=planned_sent, planned_recv=planned_recv,
                placements={name: str(tuple(p.placements)) for name, p in params},
                paths=sorted({b.path for b in plan}), groups=sorted({b.group.axis_name for b in plan}),
                memory=memory_check(opt), owners_hold=all(piece_numel(pcs[o]) > 0 for b in plan for pcs, o in zip(b.pieces, b.owners)))


def hsdp_tp() -> dict:
    """The 8-rank checks: HSDP x TP on a (2, 2, 2) mesh and EP x FSDP x TP on another, Muon and NorMuon."""
    return {rule: train_tp(rule, replicate=2) for rule in ("muon", "normuon")} | {
        f"ep_{rule}": ep_fsdp_tp(rule) for rule in ("muon", "normuon")}
