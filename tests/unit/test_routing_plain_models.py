"""Routing of plain models: a lone Linear, MLPs (deepmd-kit's fitting networks), raw weight matrices
and a one-expert bank all go to Muon, and a matrix that a heuristic sends to AdamW is named in one
warning. The cases are the checks a user of a hybrid Muon/AdamW optimizer makes on small models:
does weight decay reach the matrices, do the two algorithms keep their own state, do the lr modes
and the gram form apply to every hidden matrix.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn as nn

import muonlab
from muonlab import Muon, muon_param_groups, newton_schulz
from muonlab.models import GPT, GPTConfig, moe_config

LR, WD = 0.02, 0.01


def _routed(model, **kw):
    """(groups, {name: algorithm}, [routing warnings]) of one muon_param_groups call."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        groups = muon_param_groups(model, **kw)
    routes = {r.name: r.algorithm for r in groups.routes}
    return groups, routes, [w for w in caught if issubclass(w.category, UserWarning)]


def _exact_muon(groups, **kw):
    """Muon whose step is easy to write down: no momentum, fp32 Newton-Schulz."""
    settings = dict(lr=LR, weight_decay=WD, momentum=0.0, nesterov=False, ns_dtype=torch.float32, ns_form="plain")
    return Muon(groups, **(settings | kw))


def _set_grads(model, seed=1):
    gen = torch.Generator().manual_seed(seed)
    grads = {}
    for name, p in model.named_parameters():
        p.grad = torch.randn(p.shape, generator=gen)
        grads[name] = p.grad.clone()
    return grads


def _orthogonalized(g, form="plain"):
    return newton_schulz(g, dtype=torch.float32, form=form)


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(10, 20), nn.Tanh(), nn.Linear(20, 20), nn.Tanh(), nn.Linear(20, 5))


class RawLayer(nn.Module):
    """A layer written by hand: its own forward reads a raw (out, in) matrix."""

    def __init__(self, num_out=6, num_in=4):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(num_out, num_in) / num_in ** 0.5)

    def forward(self, x):
        return x @ self.weight.T


class OneExpertBank(nn.Module):
    """A raw (experts, out, in) expert bank with one expert."""

    def __init__(self):
        super().__init__()
        self.experts = nn.Parameter(torch.randn(1, 6, 4) / 2)

    def forward(self, x):  # x: (experts, tokens, in)
        return torch.einsum("eti,eoi->eto", x, self.experts)


class FittingLayer(nn.Module):
    """deepmd-kit's layer layout: a raw (in, out) matrix and a bias, read as x @ matrix + bias."""

    def __init__(self, num_in, num_out):
        super().__init__()
        self.matrix = nn.Parameter(torch.randn(num_in, num_out) / num_in ** 0.5)
        self.bias = nn.Parameter(torch.zeros(num_out))

    def forward(self, x):
        return torch.tanh(x @ self.matrix + self.bias)


class FittingNet(nn.Module):
    """A fitting network: hidden layers in a list, then one energy per atom."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([FittingLayer(10, 20), FittingLayer(20, 20), FittingLayer(20, 20)])
        self.final = FittingLayer(20, 1)


class Classifier(nn.Module):
    """Token embedding, blocks, and a classifier head that has no embedding's shape; a raw position
    table held next to the embedding."""

    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(50, 16)
        self.pos = nn.Parameter(torch.zeros(8, 16))
        self.blocks = nn.ModuleList(nn.ModuleDict(dict(fc=nn.Linear(16, 32), out=nn.Linear(32, 16))) for _ in range(2))
        self.head = nn.Linear(16, 3)


# ---------------------------------------------------------------- a lone Linear and plain MLPs


def test_weight_decay_reaches_a_lone_linear_through_muon():
    torch.manual_seed(0)
    model = nn.Linear(10, 10)
    groups, routes, caught = _routed(model)
    assert routes == {"weight": "muon", "bias": "adamw"} and not caught
    opt = Muon(groups, lr=LR, weight_decay=WD)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    # a zero gradient orthogonalizes to zero: only the decoupled decay moves the weight
    torch.testing.assert_close(model.weight.detach(), before["weight"] * (1 - LR * WD), rtol=0, atol=1e-7)
    assert not torch.equal(model.weight.detach(), before["weight"])
    torch.testing.assert_close(model.bias.detach(), before["bias"], rtol=0, atol=0)  # AdamW, no decay by default


def test_muon_and_adamw_keep_their_own_state_on_a_plain_mlp():
    model = _mlp()
    opt = Muon(muon_param_groups(model), lr=LR, weight_decay=WD)
    model(torch.randn(8, 10)).square().mean().backward()
    opt.step()
    for name, p in model.named_parameters():
        keys = set(opt.state[p])
        if p.ndim == 2:
            assert keys == {"momentum_buffer"}, (name, keys)
            assert opt.state[p]["momentum_buffer"].shape == p.shape
        else:
            assert keys == {"step", "exp_avg", "exp_avg_sq"}, (name, keys)
    assert [g["algorithm"] for g in opt.param_groups] == ["muon", "adamw"]
    assert {opt.param_name(p) for p in opt.param_groups[0]["params"]} == {"0.weight", "2.weight", "4.weight"}


def _ratio(shape, mode):
    rows, cols = shape
    return {"original": math.sqrt(max(1.0, rows / cols)), "match_rms_adamw": 0.2 * math.sqrt(max(rows, cols)),
            "spectral": math.sqrt(rows / cols), None: 1.0}[mode]


@pytest.mark.parametrize("mode", ["original", "match_rms_adamw", "spectral", None])
def test_every_matrix_of_a_plain_mlp_takes_the_lr_adjustment(mode):
    model = _mlp()
    opt = _exact_muon(muon_param_groups(model), adjust_lr=mode)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    grads = _set_grads(model)
    opt.step()
    for name in ("0.weight", "2.weight", "4.weight"):  # (20, 10) tall, (20, 20) square, (5, 20) wide
        p = model.get_parameter(name)
        want = before[name] * (1 - LR * WD) - LR * _ratio(p.shape, mode) * _orthogonalized(grads[name])
        torch.testing.assert_close(p.detach(), want, rtol=1e-5, atol=1e-6, msg=name)


def test_gram_form_on_a_lone_linear_10_to_20():
    torch.manual_seed(0)
    model = nn.Linear(10, 20)
    opt = _exact_muon(muon_param_groups(model), ns_form="gram")
    before = model.weight.detach().clone()
    grad = _set_grads(model)["weight"]
    opt.step()
    step = LR * math.sqrt(20 / 10) * _orthogonalized(grad, form="gram")
    torch.testing.assert_close(model.weight.detach(), before * (1 - LR * WD) - step, rtol=1e-5, atol=1e-6)
    # the gram form computes the same orthogonalization as the plain one
    plain = before * (1 - LR * WD) - LR * math.sqrt(2) * _orthogonalized(grad)
    torch.testing.assert_close(model.weight.detach(), plain, rtol=1e-3, atol=1e-4)
    assert "momentum_buffer" in opt.state[model.weight]


@pytest.mark.parametrize("final_out", [1, 3])
def test_deepmd_like_fitting_net_of_linears_goes_to_muon(final_out):
    # energy (one output) or a dipole (three): the last layer is no output head of an embedding
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(10, 20), nn.Tanh(), nn.Linear(20, 20), nn.Tanh(), nn.Linear(20, 20), nn.Tanh(),
                          nn.Linear(20, final_out))
    groups, routes, caught = _routed(model)
    assert routes["0.weight"] == routes["2.weight"] == routes["4.weight"] == "muon"
    reason = {r.name: r.reason for r in groups.routes}["6.weight"]
    if final_out == 1:  # a one-row layer: Muon would reduce it to its normalised gradient
        assert routes["6.weight"] == "adamw" and reason.startswith("one-row or one-column layer")
    else:
        assert routes["6.weight"] == "muon" and reason == "hidden matrix"
    assert not caught  # a one-row layer goes to AdamW by a clear rule, said in its reason


def test_deepmd_like_fitting_net_of_raw_matrices_goes_to_muon():
    model = FittingNet()
    groups, routes, caught = _routed(model)
    assert [routes[f"layers.{i}.matrix"] for i in range(3)] == ["muon"] * 3
    assert routes["final.matrix"] == "adamw"  # (20, 1): one column
    assert groups.views["layers.0.matrix"] == "matrix" and not caught
    opt = _exact_muon(groups, adjust_lr=None)
    before = model.layers[1].matrix.detach().clone()
    grads = _set_grads(model)
    opt.step()
    want = before * (1 - LR * WD) - LR * _orthogonalized(grads["layers.1.matrix"])
    torch.testing.assert_close(model.layers[1].matrix.detach(), want, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- raw matrices and banks


def test_raw_6x4_matrix_of_a_hand_written_layer_goes_to_muon():
    torch.manual_seed(0)
    model = RawLayer(6, 4)
    groups, routes, caught = _routed(model)
    assert routes == {"weight": "muon"} and groups.views == {"weight": "matrix"} and not caught
    opt = _exact_muon(groups)
    before = model.weight.detach().clone()
    grad = _set_grads(model)["weight"]
    opt.step()
    want = before * (1 - LR * WD) - LR * math.sqrt(6 / 4) * _orthogonalized(grad)
    torch.testing.assert_close(model.weight.detach(), want, rtol=1e-5, atol=1e-6)


def test_one_expert_raw_bank_goes_to_muon_and_steps():
    torch.manual_seed(0)
    model = OneExpertBank()
    groups, routes, caught = _routed(model)
    assert routes == {"experts": "muon"} and groups.views == {"experts": "bank"} and not caught
    assert {r.name: r.reason for r in groups.routes}["experts"] == "bank of 1 matrices"
    opt = _exact_muon(groups)
    before = model.experts.detach().clone()
    model(torch.randn(1, 5, 4)).square().sum().backward()
    grad = model.experts.grad.clone()
    opt.step()
    want = before * (1 - LR * WD) - LR * math.sqrt(6 / 4) * _orthogonalized(grad[0])
    torch.testing.assert_close(model.experts.detach(), want, rtol=1e-5, atol=1e-6)
    assert set(opt.state[model.experts]) == {"momentum_buffer"}


# ---------------------------------------------------------------- what still goes to AdamW, and says so


def test_a_heuristic_adamw_matrix_is_named_in_one_warning_with_the_override():
    groups, routes, caught = _routed(Classifier())
    assert routes["head.weight"] == routes["pos"] == routes["tok.weight"] == "adamw"
    assert routes["blocks.0.fc.weight"] == "muon"
    assert {r.name for r in groups.routes if r.guessed} == {"head.weight", "pos"}
    assert len(caught) == 1, [str(w.message) for w in caught]
    message = str(caught[0].message)
    assert "'head.weight' (3, 16)" in message and "'pos' (8, 16)" in message
    assert "include=" in message and "exclude=" in message
    assert "tok.weight" not in message  # an nn.Embedding is a clear rule
    assert issubclass(caught[0].category, getattr(muonlab.optim.routing, "RoutingWarning", ()))
    # the warning points at the caller, not at the library
    assert caught[0].filename == __file__


def test_one_warning_per_call_and_none_once_the_user_chose():
    caught = [_routed(Classifier())[2] for _ in range(2)]
    assert [len(c) for c in caught] == [1, 1]
    # choosing for the named parameters, either way, silences the warning
    _, routes, chosen = _routed(Classifier(), include=["pos"], exclude=["head.weight"])
    assert routes["pos"] == "muon" and routes["head.weight"] == "adamw" and not chosen


def test_cnn_classifier_stays_on_adamw_and_is_named():
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 4 * 4, 32), nn.ReLU(),
                          nn.Linear(32, 10))
    _, routes, caught = _routed(model)
    assert routes["3.weight"] == "muon" and routes["5.weight"] == "adamw"
    assert len(caught) == 1 and "'5.weight' (10, 32)" in str(caught[0].message)
    assert "0.weight" not in str(caught[0].message)  # convolutions: an option (conv=), not a guess


def test_vit_like_tables_stay_on_adamw_and_only_the_position_table_is_named():
    class Embeddings(nn.Module):
        def __init__(self):
            super().__init__()
            self.patch = nn.Conv2d(3, 16, 4, stride=4)
            self.cls_token = nn.Parameter(torch.zeros(1, 1, 16))
            self.position_embeddings = nn.Parameter(torch.zeros(1, 5, 16))

    model = nn.Module()
    model.embeddings = Embeddings()
    model.blocks = nn.ModuleList(nn.TransformerEncoderLayer(16, 2, 32) for _ in range(2))
    _, routes, caught = _routed(model)
    assert routes["embeddings.cls_token"] == routes["embeddings.position_embeddings"] == "adamw"
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "'embeddings.position_embeddings' (1, 5, 16)" in message and "cls_token" not in message


def test_no_warning_for_language_models_whose_head_is_the_vocabulary_projection():
    # the quickstart's routing table is printed in a checked notebook cell: no warning may join it
    for model in (GPT(GPTConfig(n_layers=1)), GPT(GPTConfig(n_layers=1, tie_embeddings=True)),
                  GPT(moe_config(n_layers=1, num_experts=2))):
        _, routes, caught = _routed(model)
        assert not caught, [str(w.message) for w in caught]
        assert routes.get("lm_head.weight", "adamw") == "adamw"


def test_raw_matrix_next_to_layers_stays_on_adamw_unless_included():
    # a raw 2-D tensor held next to submodules (learned queries, a projection added to them, a
    # state-space model's A) is no layer's own weight matrix
    model = nn.Module()
    model.A_log = nn.Parameter(torch.zeros(6, 4))
    model.proj = nn.Linear(4, 4)
    _, routes, caught = _routed(model)
    assert routes["A_log"] == "adamw" and routes["proj.weight"] == "muon"
    assert len(caught) == 1 and "'A_log' (6, 4)" in str(caught[0].message)
    _, routes, caught = _routed(model, include=["A_log"])
    assert routes["A_log"] == "muon" and not caught


def test_lookup_tables_and_empty_layers_stay_on_adamw_without_a_warning():
    # an EmbeddingBag is a table by its type (its weight is no hand-written layer's matrix), and an
    # empty (0, n) layer has nothing to orthogonalize (Muon refuses it)
    model = nn.Sequential(nn.EmbeddingBag(30, 8), nn.Linear(8, 8), nn.Linear(8, 0))
    groups, routes, caught = _routed(model)
    assert routes == {"0.weight": "adamw", "1.weight": "muon", "1.bias": "adamw", "2.weight": "adamw",
                      "2.bias": "adamw"}
    assert not caught
    Muon(groups, lr=LR, weight_decay=WD)  # builds: no empty matrix reaches Muon
