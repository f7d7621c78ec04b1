import pytest
import torch
import torch.nn as nn

from muonlab import Muon, muon_param_groups
from muonlab.models import GPT, GPTConfig, moe_config
from muonlab.simulate import mesh_specs, muon_shapes, simulate


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
    # the last Linear outside a ModuleList is the output head, whatever its shape
    model = nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 16), nn.LayerNorm(16), nn.Conv1d(16, 4, 3),
                          nn.Linear(4, 3))
    _, routes = _routes(model, adamw_lr=1e-3)
    assert routes == {"0.weight": "adamw", "1.weight": "muon", "1.bias": "adamw", "2.weight": "adamw",
                      "2.bias": "adamw", "3.weight": "adamw", "3.bias": "adamw", "4.weight": "adamw",
                      "4.bias": "adamw"}


def test_optimizer_takes_groups_and_their_names():
    model = GPT(GPTConfig(n_layers=1))
    groups = muon_param_groups(model, adamw_lr=1e-3)
    opt = Muon(groups)
    assert opt.param_groups[1]["algorithm"] == "adamw" and opt.param_groups[1]["lr"] == 1e-3
    assert opt.param_name(model.lm_head.weight) == "lm_head.weight"


def test_flattened_fsdp1_shards_are_explained_not_sent_to_adamw():
    # FSDP1 itself needs an accelerator in this torch, so build its FlatParameter directly: the
    # real class, as FSDP1's use_orig_params=False hands it to an optimizer.
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



# ---------------------------------------------------------------- stand-ins for common model shapes

class Conv1D(nn.Module):
    """transformers.pytorch_utils.Conv1D's layout: a Linear whose weight is stored (in, out)."""

    def __init__(self, nf, nx):
        super().__init__()
        self.nf, self.nx = nf, nx
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.02)
        self.bias = nn.Parameter(torch.zeros(nf))


class TinyGPT2(nn.Module):
    """GPT-2's layout: Conv1D layers in a ModuleList, a head tied to the token embedding."""

    def __init__(self, d=8, vocab=32, layers=2):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.h = nn.ModuleList(nn.ModuleDict(dict(c_fc=Conv1D(4 * d, d), c_proj=Conv1D(d, 4 * d)))
                               for _ in range(layers))
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight


class ViTBlock(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)


class ViTLike(nn.Module):
    def __init__(self, d=16, patches=9, classes=10):
        super().__init__()
        self.patch_embed = nn.Conv2d(3, d, 4, stride=4)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, d))
        self.pos_embed = nn.Parameter(torch.zeros(1, patches + 1, d))
        self.blocks = nn.ModuleList(ViTBlock(d) for _ in range(2))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)


def cnn():
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 16, 3), nn.ReLU(), nn.Flatten(),
                         nn.Linear(16 * 4 * 4, 32), nn.ReLU(), nn.Linear(32, 10))


class RawMoE(nn.Module):
    """transformers-5 MoE layout: a raw (E, D) router and a raw (E, out, in) expert bank."""

    def __init__(self, experts=4, d=16, hidden=32):
        super().__init__()
        self.router = nn.Parameter(torch.zeros(experts, d))
        self.experts = nn.Parameter(torch.zeros(experts, hidden, d))


class RawMoEModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.ModuleDict(dict(attn=nn.Linear(16, 16), moe=RawMoE())) for _ in range(2))


def _reasons(groups):
    return {r.name: r.reason for r in groups.routes}


def test_vit_tokens_position_table_patch_conv_and_classifier_go_to_adamw():
    groups, routes = _routes(ViTLike())
    assert routes["cls_token"] == routes["pos_embed"] == "adamw"
    assert routes["patch_embed.weight"] == "adamw" and routes["head.weight"] == "adamw"
    muon = sorted(n for n, a in routes.items() if a == "muon")
    assert muon == sorted(f"blocks.{i}.{m}.weight" for i in range(2) for m in ("qkv", "proj", "fc1", "fc2"))
    reasons = _reasons(groups)
    # a (1, m, n) raw tensor is a one-expert bank by its shape: the position table is told by its name
    assert "dim of size 1" in reasons["cls_token"] and "named as an embedding or position table" in reasons["pos_embed"]
    assert reasons["head.weight"] == "output head (last Linear/Conv1D outside repeated blocks)"
    assert "output head" in groups.table() and "conv='muon'" in reasons["patch_embed.weight"]
    assert set(groups.views.values()) == {"matrix"}


def test_cnn_final_fc_is_the_head_and_conv_option_flattens_kernels():
    groups, routes = _routes(cnn())
    assert routes == {"0.weight": "adamw", "0.bias": "adamw", "2.weight": "adamw", "2.bias": "adamw",
                      "5.weight": "muon", "5.bias": "adamw", "7.weight": "adamw", "7.bias": "adamw"}
    groups, routes = _routes(cnn(), conv="muon")
    assert routes["0.weight"] == routes["2.weight"] == routes["5.weight"] == "muon"
    assert groups.views == {"0.weight": "flatten", "2.weight": "flatten", "5.weight": "matrix"}
    assert _reasons(groups)["2.weight"] == "convolution kernel read as one (16, 72) matrix"


def test_raw_router_goes_to_adamw_raw_bank_to_muon_and_include_forces_muon():
    groups, routes = _routes(RawMoEModel())
    assert routes["layers.0.moe.router"] == "adamw" and routes["layers.0.moe.experts"] == "muon"
    assert routes["layers.0.attn.weight"] == "muon"  # inside the repeated blocks: not a head
    assert groups.views["layers.0.moe.experts"] == "bank"
    assert "router" in _reasons(groups)["layers.0.moe.router"]
    groups, routes = _routes(RawMoEModel(), include=["*.moe.router"])
    assert routes["layers.1.moe.router"] == "muon" and groups.views["layers.1.moe.router"] == "matrix"
    assert "included by pattern '*.moe.router'" in _reasons(groups)["layers.1.moe.router"]


def test_multihead_attention_input_projection_is_a_hidden_matrix():
    # torch's attention keeps q, k, v stacked in a raw (3D, D) parameter, a hidden matrix all the same
    model = nn.Module()
    model.layers = nn.ModuleList(nn.MultiheadAttention(16, 2, add_bias_kv=True) for _ in range(2))
    model.head = nn.Linear(16, 4)
    groups, routes = _routes(model)
    assert routes["layers.0.in_proj_weight"] == routes["layers.1.out_proj.weight"] == "muon"
    assert routes["layers.0.in_proj_bias"] == routes["layers.0.bias_k"] == routes["head.weight"] == "adamw"
    assert groups.views["layers.0.in_proj_weight"] == "matrix"


def test_conv1d_routes_to_muon_with_the_transpose_view():
    groups, routes = _routes(TinyGPT2())
    assert routes["h.0.c_fc.weight"] == "muon" and routes["h.1.c_proj.weight"] == "muon"
    assert groups.views == {f"h.{i}.{m}.weight": "transpose" for i in range(2) for m in ("c_fc", "c_proj")}
    assert "(in, out)" in _reasons(groups)["h.0.c_fc.weight"]
    # a bare backbone (every matrix layer inside the ModuleList) has no head
    backbone = TinyGPT2()
    del backbone.lm_head
    assert _routes(backbone)[0].counts() == {"muon": 4, "adamw": 5}


def test_real_transformers_conv1d_and_qwen3_moe_router():
    transformers = pytest.importorskip("transformers")
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_embd=16, n_layer=1, n_head=2, vocab_size=32, n_positions=8))
    groups, routes = _routes(gpt2)
    assert groups.views["transformer.h.0.mlp.c_fc.weight"] == "transpose"
    assert groups.views["transformer.h.0.attn.c_attn.weight"] == "transpose"
    assert routes["transformer.wpe.weight"] == "adamw" and routes["transformer.wte.weight"] == "adamw"
    qwen = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        hidden_size=16, intermediate_size=32, moe_intermediate_size=8, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, num_experts=4, num_experts_per_tok=2, vocab_size=32))
    groups, routes = _routes(qwen)
    router = [n for n in routes if n.endswith("mlp.gate.weight")]
    assert router and routes[router[0]] == "adamw"
    assert routes["lm_head.weight"] == "adamw" and routes["model.layers.0.self_attn.q_proj.weight"] == "muon"
    banks = [n for n, v in groups.views.items() if v == "bank"]
    assert len(banks) == 2, groups.table()


QUICKSTART_TABLE = """\
parameter                  shape              algorithm reason
tok_emb.weight             (256, 128)         adamw     embedding table
pos_emb.weight             (64, 128)          adamw     embedding table
blocks.0.norm1.weight      (128,)             adamw     1-D (norm scale or bias)
blocks.0.attn.qkv.weight   (384, 128)         muon      hidden matrix
blocks.0.attn.proj.weight  (128, 128)         muon      hidden matrix
blocks.0.norm2.weight      (128,)             adamw     1-D (norm scale or bias)
blocks.0.mlp.fc.weight     (512, 128)         muon      hidden matrix
blocks.0.mlp.out.weight    (128, 512)         muon      hidden matrix
blocks.1.norm1.weight      (128,)             adamw     1-D (norm scale or bias)
blocks.1.attn.qkv.weight   (384, 128)         muon      hidden matrix
blocks.1.attn.proj.weight  (128, 128)         muon      hidden matrix
blocks.1.norm2.weight      (128,)             adamw     1-D (norm scale or bias)
blocks.1.mlp.fc.weight     (512, 128)         muon      hidden matrix
blocks.1.mlp.out.weight    (128, 512)         muon      hidden matrix
norm.weight                (128,)             adamw     1-D (norm scale or bias)
lm_head.weight             (256, 128)         adamw     output head (last Linear shaped like an embedding)"""


def test_own_gpt_and_moe_routing_tables_are_unchanged():
    # the quickstart notebook prints this table (checked by nbval): the new rules must not move it
    assert muon_param_groups(GPT(GPTConfig(d_model=128, n_layers=2))).table() == QUICKSTART_TABLE
    groups = muon_param_groups(GPT(moe_config(n_layers=1, num_experts=3)))
    assert groups.views == {n: ("bank" if n.endswith(("w_in", "w_out")) else "matrix") for n in groups.views}
    assert len(groups.views) == 5


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(conv="sgd"), ValueError, "conv must be one of"),
    (dict(include=["*.nothing"]), ValueError, "include pattern '\\*.nothing' matches no trainable parameter"),
    (dict(exclude=["*.typo*"]), ValueError, "exclude pattern '\\*.typo\\*' matches no"),
    (dict(include=["*.router"], exclude=["*.moe.*"]), ValueError, "matches both exclude pattern"),
    (dict(include=["*.attn.bias"]), ValueError, "'layers.0.attn.bias' of shape \\(16,\\).*fewer than 2 dims"),
    (dict(include=[3]), TypeError, "include patterns must be strings"),
])
def test_bad_routing_options_raise_naming_the_option(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        muon_param_groups(RawMoEModel(), **kwargs)


def test_simulated_plans_read_the_views():
    model = TinyGPT2(d=8)
    assert muon_shapes(model)[0] == ("h.0.c_fc.weight", (8, 32), "transpose")
    conv, bank = mesh_specs([("conv", (8, 3, 3, 3), "flatten"), ("bank", (4, 6, 5))], 2)
    assert (conv.layout, conv.matrix_shape, conv.num_matrices, conv.rows) == ("row_shard", (8, 27), 1, (4, 4))
    assert (bank.layout, bank.matrix_shape, bank.num_matrices) == ("whole", (6, 5), 4)
    # a 4-D shape nobody declared a view for is a conv kernel, as in Muon
    (batch,) = simulate([("k", (6, 2, 3, 3))], 1)
    assert (batch.matrix_shape, batch.num_matrices) == ((6, 18), 1)
    with pytest.raises(ValueError, match="'k' of shape \\(6, 2, 3, 3\\) can't take matrix view 'matrix'"):
        simulate([("k", (6, 2, 3, 3))], 2, matrix_views={"k": "matrix"})
    with pytest.raises(ValueError, match="matrix_views names \\['q'\\]"):
        simulate([("k", (6, 2, 3, 3))], 2, matrix_views={"q": "bank"})


# ---------------------------------------------------------------- heads and banks found by a routing audit


class _Block(nn.Module):
    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.up, self.down = nn.Linear(d, hidden), nn.Linear(hidden, d)


class _Encoder(nn.Module):
    """BERT-tiny's case: 512 positions of width 128, and an intermediate layer of (512, 128)."""

    def __init__(self, heads: int = 1):
        super().__init__()
        self.tok, self.pos = nn.Embedding(1000, 128), nn.Embedding(512, 128)
        self.blocks = nn.ModuleList(_Block(128, 512) for _ in range(2))
        self.heads = nn.ModuleList(nn.Linear(128, 10) for _ in range(heads))


def _algorithms(model, **kw) -> dict[str, str]:
    return {r.name: r.algorithm for r in muon_param_groups(model, **kw).routes}


def test_a_block_layer_shaped_like_an_embedding_is_no_head():
    routes = _algorithms(_Encoder())
    assert routes["blocks.1.up.weight"] == routes["blocks.0.up.weight"] == "muon"
    assert routes["heads.0.weight"] == "adamw"


def test_parallel_heads_in_a_list_of_layers_all_go_to_adamw_and_stacks_of_layers_stay_blocks():
    routes = _algorithms(_Encoder(heads=3))
    assert [routes[f"heads.{i}.weight"] for i in range(3)] == ["adamw"] * 3
    # a stack of layers in a list (each feeds the next: not one non-square shape) is read as
    # blocks, as before: a tied head elsewhere, every layer of the stack on Muon
    for layers in ([nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 16)], [nn.Linear(16, 16) for _ in range(3)]):
        routes = _algorithms(nn.Sequential(nn.Embedding(50, 16), nn.ModuleList(layers)))
        assert [routes[f"1.{i}.weight"] for i in range(3)] == ["muon"] * 3


def test_one_expert_bank_goes_to_muon_and_a_one_row_layer_to_adamw():
    routes = _algorithms(GPT(moe_config(num_experts=1, top_k=1, d_model=32, n_layers=1, n_heads=2, context=8)))
    assert routes["blocks.0.mlp.w_in"] == routes["blocks.0.mlp.w_out"] == "muon"
    gate = nn.Sequential(nn.Embedding(10, 16), nn.Linear(16, 16), nn.Linear(16, 1), nn.Linear(16, 10))
    assert _algorithms(gate)["2.weight"] == "adamw"
