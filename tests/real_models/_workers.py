"""Tiny Hugging Face models and the worker functions of the real-model tests.

Every model is built from a config with random weights (nothing is downloaded: the hub is not
reachable from CI). Sizes are chosen so that no hidden matrix has the shape of an embedding table:
the routing rule sends any Linear shaped like an embedding to AdamW, and an accidental match would
blur what the routing tests check. Batches come from generators of their own, so every rank and the
single-process reference in the parent see the same global batch.

The distributed functions wrap the model the way a user's own training script does (torch's
``fully_shard`` per decoder layer and on the root, or torch's ``DistributedDataParallel``), not
with muonlab's ``parallelize``: muonlab.Muon must work on parameters it did not lay out itself.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from muonlab import Muon, checkpoint, muon_param_groups

VOCAB = 100
LLAMA_CFG = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
GPT2_CFG = dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=16,
                resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # no dropout: ranks and the reference agree
SEQ = 9
ROWS_PER_RANK = 2
WORLD = 2
HYPER = dict(lr=0.02, momentum=0.9, weight_decay=0.01, adamw_lr=3e-3)
# fp32 Newton-Schulz and fp32 on the wire: the distributed step then differs from the
# single-process one by summation order only
EXACT = dict(ns_dtype=torch.float32, comm_dtype=torch.float32)
TRAIN_STEPS = 3
CKPT_TOTAL = 4
CKPT_SAVE_AT = 2


def build_llama(seed: int = 0, tie: bool = False):
    """LlamaForCausalLM of LLAMA_CFG, initialised from ``torch.manual_seed(seed)``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**LLAMA_CFG, tie_word_embeddings=tie))


def build_gpt2(seed: int = 0):
    """GPT2LMHeadModel of GPT2_CFG: its attention and MLP weights are Conv1D, stored (in, out)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    return GPT2LMHeadModel(GPT2Config(**GPT2_CFG))


def global_batch(seed: int, world: int = WORLD) -> torch.Tensor:
    """(world * ROWS_PER_RANK, SEQ) random tokens from a generator seeded ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (world * ROWS_PER_RANK, SEQ), generator=gen)


def rows(batch: torch.Tensor, rank: int) -> torch.Tensor:
    return batch[rank * ROWS_PER_RANK:(rank + 1) * ROWS_PER_RANK]


def lm_loss(model, tokens: torch.Tensor) -> torch.Tensor:
    # labels == inputs: the model shifts them itself; every rank has the same token count, so the
    # data-parallel mean of per-rank means is the global batch's mean
    return model(input_ids=tokens, labels=tokens).loss


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def train(model, opt, batches) -> list[float]:
    losses = []
    for tokens in batches:
        loss = lm_loss(model, tokens)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def single_process(steps: int = TRAIN_STEPS, world: int = WORLD, build=build_llama,
                   **options) -> dict[str, torch.Tensor]:
    """The reference: one process, the whole global batch of every step."""
    model = build()
    opt = Muon(muon_param_groups(model), **EXACT, **HYPER, **options)
    train(model, opt, [global_batch(step, world) for step in range(steps)])
    return {n: p.detach().clone() for n, p in model.named_parameters()}


# ------------------------------------------------------------------ the user's own wrapping


def user_fsdp2(model, layers=None):
    """What a user's script does: fully_shard each decoder layer (Llama's by default), then the root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers if layers is None else layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _rank_batches(steps) -> list[torch.Tensor]:
    world, rank = dist.get_world_size(), dist.get_rank()
    return [rows(global_batch(step, world), rank) for step in steps]


def _trained(mode: str) -> dict:
    model = build_llama()
    if mode == "fsdp2":
        wrapped = inner = user_fsdp2(model)
    elif mode == "ddp":
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
        inner = wrapped.module
    else:
        raise ValueError(mode)
    opt = Muon(muon_param_groups(inner), **EXACT, **HYPER)
    losses = train(wrapped, opt, _rank_batches(range(TRAIN_STEPS)))
    return dict(params={n: full(p) for n, p in inner.named_parameters()}, losses=losses,
                plan=[(b.path, b.names) for b in opt.plan()],
                sharded=sorted(n for n, p in inner.named_parameters() if hasattr(p, "full_tensor")))


def _gpt2_normuon() -> dict:
    """GPT-2 (its Conv1D weights read as "transpose") under the user's FSDP2, stepped by NorMuon:
    each stored column's sum of squares spans the ranks holding the weight's rows."""
    model = build_gpt2()
    user_fsdp2(model, model.transformer.h)
    opt = Muon(muon_param_groups(model), **EXACT, **HYPER, update_rule="normuon")
    train(model, opt, _rank_batches(range(TRAIN_STEPS)))
    return dict(params={n: full(p) for n, p in model.named_parameters()},
                plan=[(b.path, b.names, b.rule_sums) for b in opt.plan()],
                transposed=sorted(n for n, v in opt._views.items() if v == "transpose"))


def _fsdp2_llama_and_opt():
    model = user_fsdp2(build_llama())
    return model, Muon(muon_param_groups(model), **HYPER)


def ckpt_save(root: str) -> dict:
    """CKPT_TOTAL steps straight; then CKPT_SAVE_AT steps and a save, on fresh model and optimizer."""
    model, opt = _fsdp2_llama_and_opt()
    straight_losses = train(model, opt, _rank_batches(range(CKPT_TOTAL)))
    straight = {n: full(p) for n, p in model.named_parameters()}
    model, opt = _fsdp2_llama_and_opt()
    saved_losses = train(model, opt, _rank_batches(range(CKPT_SAVE_AT)))
    path = os.path.join(root, "llama_fsdp2")
    checkpoint.save(path, model, opt, CKPT_SAVE_AT)
    saved = {n: full(p) for n, p in model.named_parameters()}
    return dict(straight=straight, straight_losses=straight_losses, saved=saved, saved_losses=saved_losses)


def ckpt_resume(root: str) -> dict:
    """Load the checkpoint into a fresh model and optimizer (new processes), train to CKPT_TOTAL."""
    model, opt = _fsdp2_llama_and_opt()
    step = checkpoint.load(os.path.join(root, "llama_fsdp2"), model, opt)
    loaded = {n: full(p) for n, p in model.named_parameters()}
    losses = train(model, opt, _rank_batches(range(step, CKPT_TOTAL)))
    return dict(step=step, loaded=loaded, params={n: full(p) for n, p in model.named_parameters()},
                losses=losses)


def first_launch(root: str) -> dict:
    """Every case that can share one set of processes: start-up dominates on 2 cores."""
    torch.set_num_threads(1)
    return dict(fsdp2=_trained("fsdp2"), ddp=_trained("ddp"), ckpt=ckpt_save(root), gpt2_normuon=_gpt2_normuon())


def second_launch(root: str) -> dict:
    torch.set_num_threads(1)
    return dict(resume=ckpt_resume(root))
