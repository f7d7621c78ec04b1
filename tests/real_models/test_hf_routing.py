"""muon_param_groups on real model families (transformers tiny configs, random weights) and a CNN.

The expected routing is the rule of muonlab/optim/routing.py:
  1. exclude patterns, 1-D parameters, nn.Embedding tables and weights tied to one -> AdamW
  2. the output head -> AdamW (in a model with embeddings, convolutions or a list of blocks, as
     all of these have): the last nn.Linear / transformers Conv1D in registration order that is
     not inside an nn.ModuleList (lm_head, classifier), and any Linear shaped like an embedding
  3. other nn.Linear and Conv1D weights -> Muon
  4. convolution kernels -> AdamW
  5. raw parameters (owned by none of those modules): a size-1 matrix dim -> AdamW (ViT's cls
     token); one matrix named as a table, tokens or a router -> AdamW (ViT's position embeddings,
     MoE routers in a module named gate); 3-D or more -> Muon (fused expert banks)

Each model's expectation is written out by name pattern, kind by kind, and every parameter must
fall in exactly one kind: a parameter the expectation does not know about fails the test instead
of passing unchecked.
"""

from __future__ import annotations

import fnmatch

import pytest
import torch
import torch.nn as nn
import transformers

from muonlab import muon_param_groups

from . import _workers as W

ADAMW_KINDS = ("1-D", "embedding", "head", "router", "raw token or table", "conv")
ALGORITHM = {kind: "adamw" for kind in ADAMW_KINDS} | {"muon": "muon"}


def _llama(tie):
    return W.build_llama(tie=tie)


def _qwen3_moe():
    cfg = transformers.Qwen3MoeConfig(vocab_size=W.VOCAB, hidden_size=32, intermediate_size=64,
                                      moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
                                      max_position_embeddings=64)
    return transformers.Qwen3MoeForCausalLM(cfg)


def _mixtral():
    cfg = transformers.MixtralConfig(vocab_size=W.VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=64)
    return transformers.MixtralForCausalLM(cfg)


def _gpt2():
    cfg = transformers.GPT2Config(vocab_size=W.VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def _vit():
    cfg = transformers.ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
                                 num_attention_heads=4, intermediate_size=64, num_labels=5)
    return transformers.ViTForImageClassification(cfg)


def _bert():
    # 40 positions, not 64: a position table of (64, 32) would have the shape of the intermediate
    # Linear, which the rule then sends to AdamW as embedding-shaped
    cfg = transformers.BertConfig(vocab_size=W.VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=64, max_position_embeddings=40, num_labels=3)
    return transformers.BertForSequenceClassification(cfg)


def _cnn():
    return nn.Sequential(
        nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(),
        nn.Conv2d(8, 16, 3), nn.BatchNorm2d(16), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(16, 32), nn.ReLU(),  # a hidden Linear outside any ModuleList, not the last: Muon
        nn.Linear(32, 10),
    )


_LLAMA_MUON = ["model.layers.*.self_attn.[qkvo]_proj.weight", "model.layers.*.mlp.gate_proj.weight",
               "model.layers.*.mlp.up_proj.weight", "model.layers.*.mlp.down_proj.weight"]
_MOE_MUON = ["model.layers.*.self_attn.[qkvo]_proj.weight",
             "model.layers.*.mlp.experts.gate_up_proj", "model.layers.*.mlp.experts.down_proj"]

# model -> (builder, {kind: name patterns} for every kind but "1-D", number of Muon parameters)
MODELS = {
    "llama_untied": (lambda: _llama(False), dict(
        muon=_LLAMA_MUON, embedding=["model.embed_tokens.weight"], head=["lm_head.weight"]), 14),
    "llama_tied": (lambda: _llama(True), dict(
        muon=_LLAMA_MUON, embedding=["model.embed_tokens.weight"]), 14),
    "qwen3_moe": (_qwen3_moe, dict(
        muon=_MOE_MUON, embedding=["model.embed_tokens.weight"], head=["lm_head.weight"],
        router=["model.layers.*.mlp.gate.weight"]), 12),
    "mixtral": (_mixtral, dict(
        muon=_MOE_MUON, embedding=["model.embed_tokens.weight"], head=["lm_head.weight"],
        router=["model.layers.*.mlp.gate.weight"]), 12),
    "gpt2": (_gpt2, dict(
        muon=["transformer.h.*.attn.c_attn.weight", "transformer.h.*.attn.c_proj.weight",
              "transformer.h.*.mlp.c_fc.weight", "transformer.h.*.mlp.c_proj.weight"],
        embedding=["transformer.wte.weight", "transformer.wpe.weight"]), 8),
    "vit": (_vit, dict(
        muon=["vit.layers.*.attention.[qkvo]_proj.weight", "vit.layers.*.mlp.fc[12].weight"],
        conv=["vit.embeddings.patch_embeddings.projection.weight"],
        **{"raw token or table": ["vit.embeddings.cls_token", "vit.embeddings.position_embeddings"]},
        head=["classifier.weight"]), 12),
    "bert": (_bert, dict(
        muon=["bert.encoder.layer.*.attention.self.query.weight", "bert.encoder.layer.*.attention.self.key.weight",
              "bert.encoder.layer.*.attention.self.value.weight", "bert.encoder.layer.*.output.dense.weight",
              "bert.encoder.layer.*.intermediate.dense.weight", "bert.pooler.dense.weight"],
        embedding=["bert.embeddings.*_embeddings.weight"], head=["classifier.weight"]), 13),
    "cnn": (_cnn, dict(muon=["8.weight"], conv=["0.weight", "3.weight"], head=["10.weight"]), 1),
}


def _kind(name: str, p: torch.Tensor, spec: dict) -> str:
    kinds = [k for k, patterns in spec.items() if any(fnmatch.fnmatchcase(name, pat) for pat in patterns)]
    if p.ndim == 1:
        kinds.append("1-D")
    assert len(kinds) == 1, f"{name} {tuple(p.shape)}: the expectation gives kinds {kinds}"
    return kinds[0]


def _is_conv1d(model, name):
    owner = model.get_submodule(name.rpartition(".")[0])
    return type(owner).__name__ == "Conv1D"


@pytest.mark.parametrize("model_name", list(MODELS))
def test_routing_table_follows_the_rule(model_name):
    build, spec, num_muon = MODELS[model_name]
    torch.manual_seed(0)
    model = build()
    groups = muon_param_groups(model)
    params = dict(model.named_parameters())  # tied weights appear once, under their first owner
    routes = {r.name: r for r in groups.routes}
    assert len(routes) == len(groups.routes), "a parameter is routed twice"
    assert routes.keys() == params.keys()

    kinds = {name: _kind(name, p, spec) for name, p in params.items()}
    for kind, patterns in spec.items():  # every pattern names something in this model
        for pat in patterns:
            assert any(fnmatch.fnmatchcase(n, pat) for n in params), f"{pat} matches nothing"
    wrong = {name: (kinds[name], r.algorithm, r.reason) for name, r in routes.items()
             if r.algorithm != ALGORITHM[kinds[name]]}
    assert not wrong, f"routed against the rule: {wrong}"
    assert sum(r.algorithm == "muon" for r in routes.values()) == num_muon

    for name, r in routes.items():
        shape = tuple(params[name].shape)
        # a Conv1D stores (in, out); the route may report it either way round
        assert r.shape == shape or (_is_conv1d(model, name) and r.shape == shape[::-1]), (name, r.shape)
        assert isinstance(r.reason, str) and r.reason.strip(), f"{name} has no reason"

    # the groups the optimizer gets hold exactly the routed tensors, each once
    by_algorithm = {g["algorithm"]: {id(p) for p in g["params"]} for g in groups}
    assert sum(len(g["params"]) for g in groups) == len(params)
    for name, r in routes.items():
        assert id(params[name]) in by_algorithm[r.algorithm], name

    # the reason says which rule applied: kinds the rule tells apart get different reasons
    reasons = {}
    for name, r in routes.items():
        if kinds[name] != "1-D":  # a head's bias may be named for either rule; norms and biases are
            reasons.setdefault(kinds[name], set()).add(r.reason)
    for a in reasons:
        for b in reasons:
            if a < b:
                assert not reasons[a] & reasons[b], (a, b, reasons[a] & reasons[b])

    table = groups.table().splitlines()
    assert len(table) == len(routes) + 1  # a header, then one row per parameter
    for line, r in zip(table[1:], groups.routes):
        assert line.split()[0] == r.name and r.algorithm in line and r.reason in line, line


def test_tied_llama_head_is_routed_once_with_the_embedding():
    model = _llama(True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    groups = muon_param_groups(model)
    names = [r.name for r in groups.routes]
    assert "lm_head.weight" not in names and names.count("model.embed_tokens.weight") == 1
    adamw = next(g for g in groups if g["algorithm"] == "adamw")["params"]
    assert sum(p is model.lm_head.weight for p in adamw) == 1


def test_exclude_pattern_sends_matching_matrices_to_adamw_and_says_so():
    model = _llama(False)
    groups = muon_param_groups(model, exclude=["*.mlp.down_proj.weight"])
    routes = {r.name: r for r in groups.routes}
    excluded = [n for n in routes if n.endswith("mlp.down_proj.weight")]
    assert len(excluded) == 2
    for n in excluded:
        assert routes[n].algorithm == "adamw" and "*.mlp.down_proj.weight" in routes[n].reason
    assert sum(r.algorithm == "muon" for r in routes.values()) == 12


def test_qwen3_moe_expert_banks_are_orthogonalized_expert_by_expert():
    # a fused (E, out, in) bank is E matrices: orthogonalizing the bank as one flattened matrix, or
    # across experts, would still train but is not Muon
    from muonlab import Muon, newton_schulz

    model = _qwen3_moe()
    lr = 0.02
    opt = Muon(muon_param_groups(model), lr=lr, momentum=0.0, nesterov=False, weight_decay=0.0,
               adjust_lr=None, ns_dtype=torch.float32)
    W.lm_loss(model, W.global_batch(0)).backward()
    banks = {n: p for n, p in model.named_parameters() if n.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    assert len(banks) == 4
    before = {n: p.detach().clone() for n, p in banks.items()}
    grads = {n: p.grad.detach().clone() for n, p in banks.items()}
    opt.step()
    for n, p in banks.items():
        assert grads[n].abs().sum() > 0, n
        for e in range(p.shape[0]):
            want = -lr * newton_schulz(grads[n][e], dtype=torch.float32)
            torch.testing.assert_close(p.detach()[e] - before[n][e], want, rtol=1e-4, atol=1e-6)
