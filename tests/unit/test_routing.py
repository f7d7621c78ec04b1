import torch.nn as nn

from muonlab import Muon, muon_param_groups
from muonlab.models import GPT, GPTConfig, moe_config


def _routes(model, **kw):
    groups = muon_param_groups(model, **kw)
    return groups, {r.name: r.algorithm for r in groups.routes}


def test_small_gpt_routing_table():
    groups, routes = _routes(GPT(GPTConfig(n_layers=2)))
    muon = sorted(n for n, a in routes.items() if a == "muon")
    assert muon == sorted(
        f"blocks.{i}.{m}.weight" for i in range(2) for m in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.out")
    )
    adamw = sorted(n for n, a in routes.items() if a == "adamw")
    assert adamw == sorted(
        ["tok_emb.weight", "pos_emb.weight", "norm.weight", "lm_head.weight"]
        + [f"blocks.{i}.norm{j}.weight" for i in range(2) for j in (1, 2)]
    )
    table = groups.table()
    assert "lm_head.weight" in table and "output head" in table and "embedding table" in table
    assert groups.counts() == {"muon": 8, "adamw": 8}
    # no names inside the groups themselves
    assert all(set(g) <= {"params", "algorithm", "lr"} for g in groups)


def test_moe_gpt_routes_expert_banks_to_muon():
    groups, routes = _routes(GPT(moe_config(n_layers=1, num_experts=3)))
    assert routes["blocks.0.mlp.w_in"] == "muon" and routes["blocks.0.mlp.w_out"] == "muon"
    assert routes["blocks.0.mlp.router.weight"] == "muon"
    reasons = {r.name: r.reason for r in groups.routes}
    assert reasons["blocks.0.mlp.w_in"] == "bank of 3 matrices"
    _, routes = _routes(GPT(moe_config(n_layers=1)), exclude=["*.router.*"])
    assert routes["blocks.0.mlp.router.weight"] == "adamw"


def test_tied_head_is_routed_once_to_adamw():
    model = GPT(GPTConfig(n_layers=1, tie_embeddings=True))
    groups, routes = _routes(model)
    assert "lm_head.weight" not in routes and routes["tok_emb.weight"] == "adamw"
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))


def test_custom_model_by_type_not_name():
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 16), nn.LayerNorm(16), nn.Conv1d(16, 4, 3))
    _, routes = _routes(model, adamw_lr=1e-3)
    assert routes == {"0.weight": "adamw", "1.weight": "muon", "1.bias": "adamw", "2.weight": "adamw",
                      "2.bias": "adamw", "3.weight": "adamw", "3.bias": "adamw"}


def test_optimizer_takes_groups_and_their_names():
    model = GPT(GPTConfig(n_layers=1))
    groups = muon_param_groups(model, adamw_lr=1e-3)
    opt = Muon(groups)
    assert opt.param_groups[1]["algorithm"] == "adamw" and opt.param_groups[1]["lr"] == 1e-3
    assert opt.param_name(model.lm_head.weight) == "lm_head.weight"


def test_flattened_fsdp1_shards_are_explained_not_sent_to_adamw():
    # FSDP1 itself needs an accelerator in this torch, so build its FlatParameter directly: the
    # real class, as FSDP1's use_orig_params=False hands it to an optimizer.
    import pytest
    import torch
    from torch.distributed.fsdp._flat_param import FlatParameter

    class Wrapped(nn.Module):
        def __init__(self):
            super().__init__()
            self.flat = FlatParameter(torch.zeros(8 * 16 + 16 * 4))

    model = Wrapped()
    with pytest.raises(ValueError, match=r"'flat' of shape \(192,\) is an FSDP1 FlatParameter .*fully_shard.*"
                                         r"must not silently fall back to AdamW"):
        muon_param_groups(model)
    with pytest.raises(ValueError, match="is an FSDP1 FlatParameter"):
        Muon([{"params": [("flat", model.flat)], "algorithm": "adamw"}])
