"""Per-head Newton-Schulz on one process: the declaration (muonlab.optim.heads), the optimizer
against the slow reference that orthogonalizes each block alone, the plan and cost records that
count the blocks, and refusals of bad declarations before anything changes."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import transformers

from muonlab import Muon, attention_blocks, muon_param_groups
from muonlab.comm.records import Plan, per_rank
from muonlab.kernels.config import ns_flops
from muonlab.optim.reference import reference_muon_step
from muonlab.simulate import lower_bound_bytes, muon_shapes, simulate

from muonlab.models import GPT, GPTConfig

GPT_CFG = dict(d_model=24, n_layers=2, n_heads=3, context=8)
HYPER = dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01, ns_steps=5, ns_coefficients="keller",
             eps=1e-7, adjust_lr="original", momentum_form="ema")


def build_gpt(**cfg) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(**cfg))


def _llama():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64))


def _qwen3():
    # head_dim 8 with 3 query heads over 24 features, q_norm / k_norm per head (1-D: AdamW)
    torch.manual_seed(0)
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=100, hidden_size=24, intermediate_size=40, num_hidden_layers=2, num_attention_heads=3,
        num_key_value_heads=3, head_dim=8, max_position_embeddings=32))


def test_gpt_qkv_is_declared_per_head_or_as_q_k_v_and_the_output_projection_stays_whole():
    model = build_gpt(**GPT_CFG)
    heads = muon_param_groups(model, split_heads=True)
    assert heads.fused_banks == {f"blocks.{i}.attn.qkv.weight": 9 for i in range(2)}  # 3 x 3 heads of (8, 24)
    assert muon_param_groups(model, split_heads="heads").fused_banks == heads.fused_banks
    assert muon_param_groups(model, split_heads="qkv").fused_banks == {f"blocks.{i}.attn.qkv.weight": 3
                                                                       for i in range(2)}
    assert muon_param_groups(model).fused_banks == {}
    assert attention_blocks(model) == heads.fused_banks
    assert "in 9 blocks of (8, 24) (split_heads)" in heads.table()
    # the declaration reaches Muon, and an explicit fused_banks wins by name
    opt = Muon(muon_param_groups(model, split_heads=True), fused_banks={"blocks.1.attn.qkv.weight": 1})
    assert opt.fused_banks == {"blocks.0.attn.qkv.weight": 9, "blocks.1.attn.qkv.weight": 1}


def test_hugging_face_llama_and_qwen3_q_k_v_are_declared_by_their_heads():
    llama = muon_param_groups(_llama(), split_heads=True).fused_banks
    for i in range(2):  # q: 4 heads of (8, 32); k, v: 2 key/value heads each (grouped-query attention)
        at = f"model.layers.{i}.self_attn."
        assert {n: k for n, k in llama.items() if n.startswith(at)} == {
            at + "q_proj.weight": 4, at + "k_proj.weight": 2, at + "v_proj.weight": 2}
    assert not any("o_proj" in n for n in llama)
    qwen = muon_param_groups(_qwen3(), split_heads=True)
    assert qwen.fused_banks == {f"model.layers.{i}.self_attn.{p}_proj.weight": 3 for i in range(2) for p in "qkv"}
    # q, k and v are separate matrices already: "qkv" has nothing to split there
    assert muon_param_groups(_qwen3(), split_heads="qkv").fused_banks == {}
    bert = transformers.BertModel(transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1,
                                                          num_attention_heads=4, intermediate_size=64))
    assert attention_blocks(bert) == {f"encoder.layer.0.attention.self.{p}.weight": 4 for p in ("query", "key", "value")}


def test_torch_multihead_attention_in_proj_is_declared_per_head():
    model = nn.Sequential(nn.Linear(4, 12), nn.MultiheadAttention(12, 3, batch_first=True))
    assert attention_blocks(model) == {"1.in_proj_weight": 9}
    assert attention_blocks(model, "qkv") == {"1.in_proj_weight": 3}


@pytest.mark.parametrize("build, rule", [(lambda: build_gpt(**GPT_CFG), "muon"), (_qwen3, "muon"),
                                         (lambda: build_gpt(**GPT_CFG), "normuon")],
                         ids=["gpt", "qwen3", "gpt-normuon"])
def test_each_block_is_orthogonalized_alone_as_the_slow_reference_does(build, rule):
    """fp32, 3 steps on generated gradients: every Muon matrix equals reference_muon_step, which
    orthogonalizes each declared block of rows by itself (NorMuon: and normalises its rows); and
    the split is no no-op (the whole matrices' step differs)."""
    model, whole = build(), build()
    groups = muon_param_groups(model, split_heads=True)
    opt = Muon(groups, ns_dtype=torch.float32, update_rule=rule, **HYPER)
    unsplit = Muon(muon_param_groups(whole), ns_dtype=torch.float32, update_rule=rule, **HYPER)
    muon = [r.name for r in groups.routes if r.algorithm == "muon"]
    params = dict(model.named_parameters())
    ref = {n: params[n].detach().clone() for n in muon}
    bufs = {n: torch.zeros_like(p) for n, p in ref.items()}
    variances = {n: torch.zeros(p.shape[0], 1) for n, p in ref.items()}  # NorMuon's, one per row
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        grads = {n: torch.randn(p.shape, generator=gen) for n, p in model.named_parameters()}
        for m in (model, whole):
            for n, p in m.named_parameters():
                p.grad = grads[n].clone()
        opt.step()
        unsplit.step()
        reference_muon_step([ref[n] for n in muon], [grads[n] for n in muon], [bufs[n] for n in muon],
                            num_fused=[groups.fused_banks.get(n, 1) for n in muon], update_rule=rule,
                            row_variances=[variances[n] for n in muon], **HYPER)
    for n in muon:
        torch.testing.assert_close(params[n].detach(), ref[n], rtol=1e-5, atol=1e-6, msg=n)
    split = dict(whole.named_parameters())
    for n in groups.fused_banks:
        assert (params[n] - split[n]).abs().max() > 1e-3, n  # per-head differs from whole-matrix Muon


def test_plan_resolved_choices_and_per_path_costs_count_the_blocks():
    model = build_gpt(**GPT_CFG)
    opt = Muon(muon_param_groups(model, split_heads=True), ns_dtype=torch.float32)
    (qkv,) = [b for b in opt.plan() if "blocks.0.attn.qkv.weight" in b.names]
    assert qkv.matrix_shape == (8, 24) and qkv.num_matrices == 18 and qkv.path == "local"
    (row,) = [r for r in opt.resolved_choices() if r["batch"] == qkv.index]
    assert row["shape"] == (8, 24) and row["matrices"] == 18
    # simulated on 2 and 4 FSDP2 ranks the shards cut heads (36 or 18 rows a rank, heads of 8):
    # the blocks path, each head orthogonalized once, bytes at the lower bound
    blocks = attention_blocks(model)
    for world in (2, 4):
        plan = simulate(muon_shapes(model), world, fused_banks=blocks, ns_dtype=torch.float32, device="cpu")
        (cut,) = [b for b in plan if b.path == "blocks"]
        assert cut.names == ("blocks.0.attn.qkv.weight", "blocks.1.attn.qkv.weight"), cut.names
        assert cut.matrix_shape == (8, 24) and cut.num_matrices == 18 and len(cut.owners) == 18
        assert sum(cut.bytes_sent) == lower_bound_bytes(Plan((cut,))) > 0
        flops = per_rank(plan, world, by_path=True)["blocks"]["flops"]
        assert sum(flops) == 18 * ns_flops((8, 24), cut.ns_config)


def test_the_blocks_path_bytes_are_the_bound_and_owners_hold_the_most_rows():
    """A readable count beside the closed form: each block, by the rows each rank holds of it."""
    from muonlab.comm.paths.blocks import block_pieces, bytes_per_rank

    rows, E = (3, 3, 3, 1), 5  # (10, N) in 5 blocks of 2 rows over 4 ranks
    assert block_pieces(rows, E) == [[(0, 0, 2)], [(0, 2, 1), (1, 0, 1)], [(1, 1, 2)], [(2, 0, 2)],
                                     [(2, 2, 1), (3, 0, 1)]]
    assert block_pieces((2, 2, 2, 0), 2) == [[(0, 0, 2), (1, 0, 1)], [(1, 1, 1), (2, 0, 2)]]  # an empty shard
    sent, recv = bytes_per_rank(rows, 7, E, [0, 1, 1, 2, 2], 4)
    # blocks 1 and 4 are cut: one row each goes to its owner and comes back
    assert sent == recv == [7 * 4, 7 * 4, 7 * 4, 7 * 4]
    plan = simulate([("w", (10, 7))], 4, fused_banks={"w": 5}, comm_dtype=torch.float32)
    (b,) = plan
    assert b.path == "blocks" and sum(b.bytes_sent) == lower_bound_bytes(plan) == 4 * 7 * 4


@pytest.mark.parametrize("kwargs, match", [
    (dict(fused_banks={"blocks.0.attn.qkv.weight": 5}),
     r"fused bank 'blocks.0.attn.qkv.weight' of shape \(72, 24\) .* rows divisible by 5"),
    (dict(fused_banks={"blocks.0.attn.nope": 3}), r"fused_banks names \['blocks.0.attn.nope'\] are not parameters"),
])
def test_a_bad_block_declaration_is_refused_by_name_before_anything_changes(kwargs, match):
    model = build_gpt(**GPT_CFG)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=match):
        Muon(muon_param_groups(model, split_heads=True), **kwargs)
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())


def test_split_heads_refuses_an_unknown_choice_and_a_model_without_attention():
    with pytest.raises(ValueError, match=r"split_heads must be False, True or one of \('heads', 'qkv'\), got 'kv'"):
        muon_param_groups(build_gpt(**GPT_CFG), split_heads="kv")
    with pytest.raises(ValueError, match=r"split_heads=True: no attention projection found in Sequential"):
        muon_param_groups(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)), split_heads=True)
    with pytest.raises(ValueError, match=r"split must be one of"):
        attention_blocks(build_gpt(**GPT_CFG), "rows")


@pytest.mark.parametrize("rule", ["muon", "normuon"])
def test_split_heads_resume_from_a_state_dict_and_offload_bit_for_bit(tmp_path, rule):
    """Per-head blocks (with Muon's or NorMuon's update) keep their state per parameter as before:
    runs with state offloaded to host memory or disk, and a run resumed from a state dict saved
    after step 2, take the same 3 steps bit for bit as the resident run."""
    import io

    gen = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, 256, (2, GPT_CFG["context"] + 1), generator=gen) for _ in range(3)]

    def optimizer(model, **extra):
        return Muon(muon_param_groups(model, split_heads=True), ns_dtype=torch.float32, update_rule=rule, **extra)

    def train(model, opt, steps):
        for x in steps:
            model(x[:, :-1], x[:, 1:]).backward()
            opt.step()
            opt.zero_grad()

    def params(model):
        return {n: p.detach().clone() for n, p in model.named_parameters()}

    model = build_gpt(**GPT_CFG)
    opt = optimizer(model)
    train(model, opt, batches[:2])
    saved = io.BytesIO()
    torch.save((model.state_dict(), opt.state_dict()), saved)
    train(model, opt, batches[2:])
    want = params(model)
    for extra in (dict(state_offload="cpu"), dict(state_offload="disk", offload_dir=str(tmp_path / "disk"))):
        other = build_gpt(**GPT_CFG)
        train(other, optimizer(other, **extra), batches)
        assert all(torch.equal(p, want[n]) for n, p in params(other).items()), extra
    saved.seek(0)
    model_state, opt_state = torch.load(saved, weights_only=False)
    resumed = build_gpt(**GPT_CFG)
    resumed.load_state_dict(model_state)
    opt = optimizer(resumed)
    opt.load_state_dict(opt_state)
    train(resumed, opt, batches[2:])
    assert all(torch.equal(p, want[n]) for n, p in params(resumed).items())
