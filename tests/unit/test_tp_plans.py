"""parallelize's "fsdp+tp" plans and refusals, in one process (no launch): muonlab's GPT and a tiny
Hugging Face Llama (random weights, no download); every refusal before anything changes."""

import pytest
import torch

from muonlab.distributed import parallelize
from muonlab.distributed.parallelize import default_tp_plan
from muonlab.models import GPT, GPTConfig


def tiny_llama(heads: int = 4, kv_heads: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                                        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=4,
                                        max_position_embeddings=16))


def test_llama_plan_splits_attention_and_mlp_by_whole_heads():
    plan = {n: type(s).__name__ for n, s in default_tp_plan(tiny_llama(), 2).items()}
    for layer in ("model.layers.0", "model.layers.1"):
        for proj in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            assert plan.pop(f"{layer}.{proj}") == "ColwiseParallel"
        for proj in ("self_attn.o_proj", "mlp.down_proj"):
            assert plan.pop(f"{layer}.{proj}") == "RowwiseParallel"
    assert plan == {}  # embeddings, norms and the head stay replicated over TP
    with pytest.raises(ValueError, match="tp=4 must divide the heads of attention 'model.layers.0.self_attn' "
                                         "\\(4 query, 2 key/value heads\\)"):
        default_tp_plan(tiny_llama(), 4)


def test_gpt_plan_keeps_the_fused_qkv_whole():
    gpt = GPT(GPTConfig(d_model=8, n_layers=1, n_heads=2, context=4))
    plan = default_tp_plan(gpt, 2)
    assert sorted(plan) == ["blocks.0.attn.proj", "blocks.0.mlp.fc", "blocks.0.mlp.out"]
    # the attention's output projection reads the replicated heads' outputs: its own block of them
    assert str(plan["blocks.0.attn.proj"].input_layouts) == "(Replicate(),)"


def test_fsdp_tp_refusals_name_the_argument():
    gpt = GPT(GPTConfig(d_model=8, n_layers=1, n_heads=2, context=4))
    before = {n: p.detach().clone() for n, p in gpt.named_parameters()}
    with pytest.raises(ValueError, match="needs tp \\(the tensor-parallel size\\) or a 2-D mesh"):
        parallelize(gpt, "fsdp+tp")
    with pytest.raises(ValueError, match="tp is read in 'fsdp\\+tp' mode only"):
        parallelize(gpt, "fsdp", tp=2)
    with pytest.raises(TypeError, match="parallelize_plan must be a dict"):
        parallelize(gpt, "fsdp+tp", tp=2, parallelize_plan={"blocks.0.mlp.fc": "colwise"})
    # no process group: the mesh is refused by build_mesh before the model moves
    with pytest.raises(RuntimeError, match="build_mesh needs an initialised default process group"):
        parallelize(gpt, "fsdp+tp", tp=2)
    assert all(torch.equal(p, before[n]) for n, p in gpt.named_parameters())
    assert not any(type(p).__name__ == "DTensor" for p in gpt.parameters())
