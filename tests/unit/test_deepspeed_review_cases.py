"""The cases the review of DeepSpeed's ZeRO Muon (DeepSpeed PR #7919) added, as tests of muonlab.Muon.

1. Frozen parameters: a GPT with all but two matrices and one 1-D scale frozen; groups whose
   parameters are all frozen; a parameter frozen in the middle of training.
2. Separate Muon and AdamW learning rates driven by torch LR schedulers (LambdaLR with one lambda
   per group, StepLR), step by step against torch.optim.Muon + torch.optim.AdamW.
3. Groups with different momentum coefficients.

Decision for 3: SUPPORTED. DeepSpeed's ZeRO Muon keeps one fused momentum buffer across all Muon
groups, so its review added a check that every Muon group shares one momentum coefficient. muonlab
keeps a momentum buffer per parameter and applies it (``functional.muon_momentum_`` with that
parameter's ``group["momentum"]``, ``nesterov`` and ``momentum_form``) on each parameter BEFORE the
matrices are batched; a batch carries only what Newton-Schulz needs (its NSConfig), and the
planner puts matrices of different groups in one batch only when their NSConfigs are equal (the
lr, weight decay and adjust_lr are read per parameter again at the update). So a coefficient per
group is no harder than per parameter, and refusing it would only take a feature away. The tests
check that two Muon groups (momentum 0.9 and 0.95) each match torch.optim.Muon run on that group
alone, that their same-shape matrices share one Newton-Schulz batch when the NS settings agree, and
that they are split into separate batches, still matching, when ``ns_steps`` differs.

References run Newton-Schulz in fp32 on both sides (torch.optim.Muon's bf16 cast patched out, as
tests/unit/test_muon.py's tight parity test does), so parity is to ~1e-6, far below the effect of a
swapped learning rate, a skipped schedule or a swapped momentum.
"""

import copy
import math

import pytest
import torch
import torch.optim._muon as torch_muon

from muonlab import Muon, muon_param_groups
from muonlab.kernels.reference import reference_newton_schulz
from muonlab.models import GPT, GPTConfig

MUON_HYPER = dict(lr=0.02, weight_decay=0.01)
ADAMW_HYPER = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
TOL = 1e-5  # relative displacement; measured ~1e-7 with fp32 Newton-Schulz on both sides


@pytest.fixture(autouse=True)
def fp32_torch_newton_schulz(monkeypatch):
    def fp32_ns(grad, ns_coefficients, ns_steps, eps):
        return reference_newton_schulz(grad, ns_steps, [ns_coefficients], eps, dtype=torch.float32)

    monkeypatch.setattr(torch_muon, "_zeropower_via_newtonschulz", fp32_ns)


def _ours(groups, **kwargs):
    return Muon(groups, lr=MUON_HYPER["lr"], weight_decay=MUON_HYPER["weight_decay"],
                adamw_lr=ADAMW_HYPER["lr"], adamw_betas=ADAMW_HYPER["betas"], adamw_eps=ADAMW_HYPER["eps"],
                adamw_weight_decay=ADAMW_HYPER["weight_decay"], ns_dtype=torch.float32, **kwargs)


def _torch_muon(params, **kwargs):
    return torch.optim.Muon(params, **{**MUON_HYPER, **kwargs}, adjust_lr_fn="original")


def _torch_adamw(params, **kwargs):
    return torch.optim.AdamW(params, **{**ADAMW_HYPER, **kwargs})


def _clones(params):
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


def _rel_displacement(ours, ref, start):
    """max over parameters of |ours - ref| / |ref - start|: 0 for equal updates, ~1 for a wrong one."""
    worst = 0.0
    for a, b, c in zip(ours, ref, start):
        moved = (b.detach() - c).norm()
        assert moved > 0, "the reference parameter did not move: the comparison would be vacuous"
        worst = max(worst, ((a.detach() - b.detach()).norm() / moved).item())
    return worst


def _assert_matches(ours, ref, start):
    assert _rel_displacement(ours, ref, start) <= TOL


# ---------------------------------------------------------------- 1. frozen parameters


TRAINABLE_MUON = ("blocks.0.attn.proj.weight", "blocks.1.attn.proj.weight")  # same shape: one batch
TRAINABLE_ADAMW = ("norm.weight",)  # the GPT has no biases; its 1-D final norm scale stands in


def _frozen_gpt(seed=0, trainable=TRAINABLE_MUON + TRAINABLE_ADAMW):
    torch.manual_seed(seed)
    model = GPT(GPTConfig(d_model=32, n_layers=2, context=16))
    for name, p in model.named_parameters():
        p.requires_grad_(name in trainable)
    return model


def _backward(model, gen):
    x = torch.randint(0, 256, (4, 16), generator=gen)
    for p in model.parameters():
        p.grad = None
    model(x, x).backward()


def _snapshot(model, names):
    params = dict(model.named_parameters())
    return {n: params[n].detach().clone() for n in names}


def test_mostly_frozen_gpt_routes_only_trainable_and_matches_torch():
    model = _frozen_gpt()
    params = dict(model.named_parameters())
    frozen = [n for n in params if n not in TRAINABLE_MUON + TRAINABLE_ADAMW]
    assert len(frozen) == len(params) - 3

    groups = muon_param_groups(model)
    assert [r.name for r in groups.routes] == sorted(TRAINABLE_MUON + TRAINABLE_ADAMW,
                                                     key=list(params).index)
    assert {r.name: r.algorithm for r in groups.routes} == {
        **{n: "muon" for n in TRAINABLE_MUON}, **{n: "adamw" for n in TRAINABLE_ADAMW}}
    assert [(g["algorithm"], len(g["params"])) for g in groups] == [("muon", 2), ("adamw", 1)]
    opt = _ours(groups)
    (batch,) = opt.plan()
    assert set(batch.names) == set(TRAINABLE_MUON) and batch.num_matrices == 2

    muon_params = [params[n] for n in TRAINABLE_MUON]
    adamw_params = [params[n] for n in TRAINABLE_ADAMW]
    ref_muon, ref_adamw = _clones(muon_params), _clones(adamw_params)
    torch_opts = [_torch_muon(ref_muon), _torch_adamw(ref_adamw)]
    start = [p.detach().clone() for p in muon_params + adamw_params]
    frozen_before = _snapshot(model, frozen)

    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        _backward(model, gen)
        assert all(params[n].grad is None for n in frozen)
        for p, q in zip(muon_params + adamw_params, ref_muon + ref_adamw):
            q.grad = p.grad.clone()
        opt.step()
        for o in torch_opts:
            o.step()
        _assert_matches(muon_params + adamw_params, ref_muon + ref_adamw, start)

    for n in frozen:
        assert torch.equal(params[n].detach(), frozen_before[n]), n
        assert params[n] not in opt.state, n
    assert set(opt.state) == set(muon_params + adamw_params)
    # the state itself, not only the parameters, matches torch's
    for p, q in zip(muon_params, ref_muon):
        torch.testing.assert_close(opt.state[p]["momentum_buffer"], torch_opts[0].state[q]["momentum_buffer"])
    for p, q in zip(adamw_params, ref_adamw):
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(opt.state[p][key], torch_opts[1].state[q][key])
        assert float(opt.state[p]["step"]) == 5


def test_groups_of_only_frozen_parameters_are_fine():
    model = _frozen_gpt()
    params = dict(model.named_parameters())
    groups = [
        # every parameter frozen, one group per algorithm
        {"params": [params["blocks.0.mlp.fc.weight"], params["blocks.0.mlp.out.weight"]]},
        {"params": [params["tok_emb.weight"], params["pos_emb.weight"]], "algorithm": "adamw"},
        # trainable and frozen mixed in one group; the frozen qkv shares no batch with anything
        {"params": [params["blocks.0.attn.proj.weight"], params["blocks.1.attn.qkv.weight"],
                    params["blocks.1.attn.proj.weight"]]},
        {"params": [params["blocks.0.norm1.weight"], params["norm.weight"]], "algorithm": "adamw"},
    ]
    opt = _ours(groups)
    listed = [p for g in groups for p in g["params"]]
    trainable = [p for p in listed if p.requires_grad]
    frozen = [p for p in listed if not p.requires_grad]
    assert len(trainable) == 3 and len(frozen) == 6
    muon_params = [params[n] for n in TRAINABLE_MUON]
    adamw_params = [params[n] for n in TRAINABLE_ADAMW]
    ref_muon, ref_adamw = _clones(muon_params), _clones(adamw_params)
    torch_opts = [_torch_muon(ref_muon), _torch_adamw(ref_adamw)]
    start = [p.detach().clone() for p in muon_params + adamw_params]
    frozen_before = [p.detach().clone() for p in frozen]

    gen = torch.Generator().manual_seed(2)
    for _ in range(3):
        _backward(model, gen)
        for p, q in zip(muon_params + adamw_params, ref_muon + ref_adamw):
            q.grad = p.grad.clone()
        opt.step()
        for o in torch_opts:
            o.step()
        assert not opt.last_step_stats()["skipped"]
    _assert_matches(muon_params + adamw_params, ref_muon + ref_adamw, start)
    for p, before in zip(frozen, frozen_before):
        assert p.grad is None and torch.equal(p.detach(), before) and p not in opt.state

    # an optimizer whose every group is frozen: step() is a no-op, not an error
    only_frozen = _ours(groups[:2])
    before = [p.detach().clone() for g in groups[:2] for p in g["params"]]
    only_frozen.step()
    assert len(only_frozen.state) == 0
    assert all(torch.equal(p.detach(), b) for p, b in zip([p for g in groups[:2] for p in g["params"]], before))
    assert only_frozen.last_step_stats()["skipped"] is False


def test_parameter_frozen_mid_training_keeps_value_and_state():
    model = _frozen_gpt()
    params = dict(model.named_parameters())
    opt = _ours(muon_param_groups(model))  # routed while both matrices were trainable
    muon_params = [params[n] for n in TRAINABLE_MUON]
    ref_muon = _clones(muon_params)
    ref = _torch_muon(ref_muon)
    start = [p.detach().clone() for p in muon_params]
    gen = torch.Generator().manual_seed(3)

    def one_step():
        _backward(model, gen)
        for p, q in zip(muon_params, ref_muon):
            q.grad = None if p.grad is None else p.grad.clone()
        opt.step()
        ref.step()

    for _ in range(2):
        one_step()
    late = params[TRAINABLE_MUON[1]]
    late.requires_grad_(False)
    value, buf = late.detach().clone(), opt.state[late]["momentum_buffer"].clone()
    for _ in range(3):
        one_step()
        assert late.grad is None
    assert torch.equal(late.detach(), value)
    assert torch.equal(opt.state[late]["momentum_buffer"], buf)
    _assert_matches(muon_params, ref_muon, start)  # the other one kept matching; torch skips it too


# ---------------------------------------------------------------- 2. Muon and AdamW lrs with schedulers


SHAPES_MUON = [(24, 64), (64, 24), (40, 40)]  # wide, tall, square
SHAPES_ADAMW = [(16,), (8, 12)]  # a 1-D scale and a 2-D table
MUON_LR, ADAMW_LR = 0.02, 1e-3


def _params(shapes, seed):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes]


def _muon_lambda(step):
    return 1.0 / (1.0 + step)  # decay


def _adamw_lambda(step):
    return min(1.0, (step + 1) / 4)  # warm-up: different from the Muon group's schedule


SCHEDULERS = {
    "lambda_per_group": (
        lambda opt, which: torch.optim.lr_scheduler.LambdaLR(
            opt, {"muon": _muon_lambda, "adamw": _adamw_lambda, "both": [_muon_lambda, _adamw_lambda]}[which]),
        lambda base, which, k: base * {"muon": _muon_lambda, "adamw": _adamw_lambda}[which](k),
    ),
    "step": (
        lambda opt, which: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.3),
        lambda base, which, k: base * 0.3 ** (k // 2),
    ),
}


@pytest.mark.parametrize("kind", sorted(SCHEDULERS))
def test_separate_muon_and_adamw_lrs_follow_their_schedules(kind):
    make_sched, expected_lr = SCHEDULERS[kind]
    mats, vecs = _params(SHAPES_MUON, seed=0), _params(SHAPES_ADAMW, seed=1)
    ref_mats, ref_vecs = _clones(mats), _clones(vecs)
    start = [p.detach().clone() for p in mats + vecs]
    opt = Muon([{"params": mats}, {"params": vecs, "algorithm": "adamw"}], lr=MUON_LR, adamw_lr=ADAMW_LR,
               weight_decay=0.01, adamw_weight_decay=0.1, ns_dtype=torch.float32)
    ref_muon = torch.optim.Muon(ref_mats, lr=MUON_LR, weight_decay=0.01, adjust_lr_fn="original")
    ref_adamw = torch.optim.AdamW(ref_vecs, lr=ADAMW_LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    scheds = [make_sched(opt, "both"), make_sched(ref_muon, "muon"), make_sched(ref_adamw, "adamw")]
    assert [g["lr"] for g in opt.param_groups] == [expected_lr(MUON_LR, "muon", 0), expected_lr(ADAMW_LR, "adamw", 0)]

    gen = torch.Generator().manual_seed(4)
    for k in range(1, 7):
        for p, q in zip(mats + vecs, ref_mats + ref_vecs):
            p.grad = torch.randn(p.shape, generator=gen)
            q.grad = p.grad.clone()
        for o in (opt, ref_muon, ref_adamw):
            o.step()
        # each optimizer's update used the lr its own group held before this step
        _assert_matches(mats, ref_mats, start[:len(mats)])
        _assert_matches(vecs, ref_vecs, start[len(mats):])
        for s in scheds:
            s.step()
        muon_lr, adamw_lr = (g["lr"] for g in opt.param_groups)
        assert math.isclose(muon_lr, expected_lr(MUON_LR, "muon", k), rel_tol=1e-12)
        assert math.isclose(adamw_lr, expected_lr(ADAMW_LR, "adamw", k), rel_tol=1e-12)
        assert (muon_lr, adamw_lr) == (ref_muon.param_groups[0]["lr"], ref_adamw.param_groups[0]["lr"])
    assert opt.param_groups[0]["lr"] != MUON_LR  # the schedule really moved the lrs
    assert [g["initial_lr"] for g in opt.param_groups] == [MUON_LR, ADAMW_LR]


def test_scheduler_state_round_trips_with_separate_lrs():
    mats, vecs = _params(SHAPES_MUON, seed=0), _params(SHAPES_ADAMW, seed=1)
    opt = Muon([{"params": mats}, {"params": vecs, "algorithm": "adamw"}], lr=MUON_LR, adamw_lr=ADAMW_LR)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, [_muon_lambda, _adamw_lambda])
    for p in mats + vecs:
        p.grad = torch.ones_like(p)
    for _ in range(3):
        opt.step()
        sched.step()
    opt2 = Muon([{"params": _clones(mats)}, {"params": _clones(vecs), "algorithm": "adamw"}], lr=0.5, adamw_lr=0.5)
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, [_muon_lambda, _adamw_lambda])
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    sched2.load_state_dict(sched.state_dict())
    sched.step()
    sched2.step()
    assert [g["lr"] for g in opt2.param_groups] == [g["lr"] for g in opt.param_groups] == [
        MUON_LR * _muon_lambda(4), ADAMW_LR * _adamw_lambda(4)]


# ---------------------------------------------------------------- 3. momentum per group


MOMENTA = (0.9, 0.95)
SAME_SHAPES = [(24, 64), (40, 40)]  # both groups hold these shapes: the batches can mix groups


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("second_ns_steps", [5, 3])
def test_groups_with_different_momentum_each_match_torch(nesterov, second_ns_steps):
    first, second = _params(SAME_SHAPES, seed=0), _params(SAME_SHAPES, seed=1)
    names = {p: f"g{gi}.{i}" for gi, ps in enumerate((first, second)) for i, p in enumerate(ps)}
    opt = Muon([{"params": [(names[p], p) for p in first], "momentum": MOMENTA[0]},
                {"params": [(names[p], p) for p in second], "momentum": MOMENTA[1], "ns_steps": second_ns_steps}],
               lr=MUON_LR, weight_decay=0.01, nesterov=nesterov, ns_dtype=torch.float32)
    assert [g["momentum"] for g in opt.param_groups] == list(MOMENTA)

    # one batch per shape holding both groups' matrices when the NS settings agree, else one per group
    batches = {(b.matrix_shape, b.ns_config.steps): set(b.names) for b in opt.plan()}
    if second_ns_steps == 5:
        assert batches == {((24, 64), 5): {"g0.0", "g1.0"}, ((40, 40), 5): {"g0.1", "g1.1"}}
    else:
        assert batches == {((24, 64), 5): {"g0.0"}, ((40, 40), 5): {"g0.1"},
                           ((24, 64), 3): {"g1.0"}, ((40, 40), 3): {"g1.1"}}

    ref_first, ref_second = _clones(first), _clones(second)
    refs = [torch.optim.Muon(ref_first, lr=MUON_LR, weight_decay=0.01, momentum=MOMENTA[0], nesterov=nesterov,
                             adjust_lr_fn="original"),
            torch.optim.Muon(ref_second, lr=MUON_LR, weight_decay=0.01, momentum=MOMENTA[1], nesterov=nesterov,
                             ns_steps=second_ns_steps, adjust_lr_fn="original")]
    _step_side_by_side(opt, refs, first + second, ref_first + ref_second, steps=6, seed=5)
    for r, ours in zip(refs, (first, second)):
        for p, q in zip(ours, r.param_groups[0]["params"]):
            torch.testing.assert_close(opt.state[p]["momentum_buffer"], r.state[q]["momentum_buffer"])
    # the groups really differ: a single shared coefficient would have given other buffers
    assert not torch.allclose(opt.state[first[0]]["momentum_buffer"], opt.state[second[0]]["momentum_buffer"])


def _step_side_by_side(opt, refs, ours, theirs, *, steps: int, seed: int) -> None:
    """The same random gradients into muonlab and the torch references, step by step; then compare."""
    start = [p.detach().clone() for p in ours]
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p, q in zip(ours, theirs):
            p.grad = torch.randn(p.shape, generator=gen)
            q.grad = p.grad.clone()
        opt.step()
        for r in refs:
            r.step()
    _assert_matches(ours, theirs, start)


def test_momentum_written_per_group_after_construction_is_used():
    """Changing one group's momentum (as a user or a scheduler may) changes that group only."""
    first, second = _params(SAME_SHAPES, seed=0), _params(SAME_SHAPES, seed=1)
    opt = Muon([{"params": first}, {"params": second}], lr=MUON_LR, ns_dtype=torch.float32)
    opt.param_groups[1]["momentum"] = 0.5
    ref_first, ref_second = _clones(first), _clones(second)
    refs = [torch.optim.Muon(ref_first, lr=MUON_LR, weight_decay=0.0, momentum=0.95, adjust_lr_fn="original"),
            torch.optim.Muon(ref_second, lr=MUON_LR, weight_decay=0.0, momentum=0.5, adjust_lr_fn="original")]
    _step_side_by_side(opt, refs, first + second, ref_first + ref_second, steps=4, seed=6)
