"""QK-clip (muonlab.optim.qk_clip) on one process: the recorded max logit against a slow reference,
the clip's guarantee (exact on the weights it measured; after a step, the same batch reads tau
times the step's growth), heads under tau bit-identical, the grouped-query rule on Hugging Face
Llama, the shared-norm rule on Qwen3, the training helper, and bad input refused before anything
changes."""

from __future__ import annotations

import inspect
import math

import pytest
import torch
import torch.nn as nn

from muonlab import Muon, muon_param_groups
from muonlab.models import GPT, GPTConfig
from muonlab.models.gpt import Attention
from muonlab.optim.qk_clip import QKClip, QKHeads, clip_factors
from muonlab.models.qk_logits import max_logits_per_head

CFG = dict(d_model=24, n_heads=3, n_layers=2, context=12)


def _gpt(seed=0, boost=3.0, **cfg):
    """A GPT whose q/k rows are ``boost`` times their init, so the logits reach a few tens."""
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**{**CFG, **cfg}))
    with torch.no_grad():
        for b in model.blocks:
            b.attn.qkv.weight[: 2 * b.attn.proj.in_features].mul_(boost)
    return model


def _tokens(seed=1, rows=4, width=13):
    return torch.randint(0, 256, (rows, width), generator=torch.Generator().manual_seed(seed))


def _attention_inputs(model):
    """{attention module: its input} of the next forward (forward pre-hooks, removed after)."""
    seen, handles = {}, []
    for m in model.modules():
        if isinstance(m, Attention):
            handles.append(m.register_forward_pre_hook(lambda mod, args: seen.__setitem__(mod, args[0].detach())))
    return seen, handles


def reference_max_logits(attn: Attention, x: torch.Tensor) -> list[float]:
    """Slow and plain: per head, per row and query, the largest q_i . k_j / sqrt(d) over keys j <= i."""
    C = attn.proj.in_features
    d = C // attn.n_heads
    w = attn.qkv.weight.detach().double()
    out = []
    for h in range(attn.n_heads):
        wq, wk = w[h * d:(h + 1) * d], w[C + h * d:C + (h + 1) * d]
        best = -math.inf
        for row in x.double():
            q, k = row @ wq.T, row @ wk.T
            for i in range(row.shape[0]):
                for j in range(i + 1):
                    best = max(best, float(q[i] @ k[j]) / math.sqrt(d))
        out.append(best)
    return out


# ---------------------------------------------------------------------------------- recording


def test_gpt_records_the_reference_max_and_leaves_the_forward_alone():
    model = _gpt()
    x = _tokens()[:, :-1]
    plain = model(x)
    assert all(b.attn.qk_max_logit is None for b in model.blocks)
    clip = QKClip(model, tau=1e9)
    seen, handles = _attention_inputs(model)
    recorded = model(x)
    for h in handles:
        h.remove()
    assert torch.equal(plain, recorded)  # recording adds nothing to the forward's result
    for b in model.blocks:
        ref = reference_max_logits(b.attn, seen[b.attn])
        assert b.attn.qk_max_logit.tolist() == pytest.approx(ref, rel=1e-5), (ref, b.attn.qk_max_logit)
    clip.close()
    assert all(not b.attn.qk_recording and b.attn.qk_max_logit is None for b in model.blocks)


def test_max_logits_respect_the_causal_mask_and_a_boolean_mask():
    q = torch.tensor([10.0, 0.0, 1.0]).view(1, 1, 3, 1)
    k = torch.tensor([0.0, 2.0, -10.0]).view(1, 1, 3, 1)
    # q0 . k1 = 20 sits above the diagonal; under it the largest is q2 . k1 = 2
    assert max_logits_per_head(q, k, 1.0, causal=False).item() == 20.0
    assert max_logits_per_head(q, k, 1.0).item() == 2.0
    mask = torch.ones(3, 3, dtype=torch.bool)
    mask[2, 1] = False
    assert max_logits_per_head(q, k, 1.0, mask=mask).item() == 0.0


# ---------------------------------------------------------------------------------- the clip


def test_clip_on_the_measured_weights_is_exact_and_spares_heads_under_tau():
    model = _gpt()
    x = _tokens()[:, :-1]
    clip = QKClip(model, tau=1e9)  # measure first
    model(x)
    maxima = torch.stack([b.attn.qk_max_logit for b in model.blocks])
    tau = float(maxima.flatten().sort().values[maxima.numel() // 2])  # half the heads pass it
    clip.close()
    clip = QKClip(model, tau=tau)
    seen, handles = _attention_inputs(model)
    model(x)
    for h in handles:
        h.remove()
    before = {b.attn: b.attn.qkv.weight.detach().clone() for b in model.blocks}
    step = clip.apply()
    assert 0 < step.clipped_heads < maxima.numel()
    for b, m, gamma in zip(model.blocks, step.max_logit, step.gamma):
        attn, C = b.attn, b.attn.proj.in_features
        d = C // attn.n_heads
        attn(seen[attn])  # the same input: only this layer's weights changed
        after = attn.qk_max_logit
        attn.qk_max_logit = None
        for h in range(attn.n_heads):
            rows = [slice(h * d, (h + 1) * d), slice(C + h * d, C + (h + 1) * d)]
            if m[h] > tau:
                assert gamma[h] == pytest.approx(tau / float(m[h]))
                assert float(after[h]) == pytest.approx(tau, rel=1e-5)
                assert all(not torch.equal(attn.qkv.weight[r], before[attn][r]) for r in rows)
            else:
                assert gamma[h] == 1.0 and float(after[h]) == float(m[h])
                assert all(torch.equal(attn.qkv.weight[r], before[attn][r]) for r in rows)
        v = slice(2 * C, 3 * C)
        assert torch.equal(attn.qkv.weight[v], before[attn][v])  # values never


def _calls_of(clip):
    """({attention module: (args, kwargs)} of the next forward, the pre-hooks' handles to remove)."""
    seen = {}
    handles = [h.module.register_forward_pre_hook(lambda mod, a, kw: seen.__setitem__(mod, (a, kw)), with_kwargs=True)
               for h in clip.heads]
    return seen, handles


def _max_of(clip, forward):
    """Each layer's max logit per head in ``forward()`` (no_grad), leaving the clip's record as it was."""
    kept = [h.module.qk_max_logit for h in clip.heads]
    for h in clip.heads:
        h.module.qk_max_logit = None
    with torch.no_grad():
        forward()
    seen = [h.module.qk_max_logit for h in clip.heads]
    for h, m in zip(clip.heads, kept):
        h.module.qk_max_logit = m
    return seen


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_after_step_and_clip_the_same_batch_reads_tau_times_the_steps_growth(kind):
    """Kimi's order: this step's forward, the step, then the clip with the forward's max. A clipped
    head's logits scale by exactly gamma = tau / max (the max before the step), so the same batch
    recomputed after step and clip reads tau times that head's growth over the step: at most tau
    only where the step did not grow it (this lr grows some past 1.05 x tau). Heads under tau keep
    their logits; each layer is recomputed on the input it saw after the step."""
    if kind == "gpt":
        model, x = _gpt(), _tokens()
        opt = Muon(muon_param_groups(model, adamw_lr=1e-3), lr=0.3, ns_dtype=torch.float32)
        loss, forward = (lambda: model(x[:, :-1], x[:, 1:])), (lambda: model(x[:, :-1]))
    else:  # grouped-query attention: 4 heads, 2 kv heads
        model, x = _hf("llama"), torch.randint(0, 100, (3, 10), generator=torch.Generator().manual_seed(2))
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        loss = lambda: model(input_ids=x, labels=x, use_cache=False).loss  # noqa: E731
        forward = lambda: model(input_ids=x, use_cache=False)  # noqa: E731
    probe = QKClip(model, tau=math.inf)
    first = _max_of(probe, forward)[0]
    probe.close()
    tau = float(first.sort().values[1])  # the first layer: one head under tau, the others over
    clip = QKClip(model, tau=tau)
    loss().backward()
    opt.step()
    calls, handles = _calls_of(clip)
    stepped = _max_of(clip, forward)
    for handle in handles:
        handle.remove()
    step = clip.apply()
    assert step.tau == tau and step.overshoot == pytest.approx(float(torch.cat(step.max_logit).max()) / tau)
    clipped = _max_of(clip, lambda: [h.module(*calls[h.module][0], **calls[h.module][1]) for h in clip.heads])
    over_tau = []
    for m, gamma, s, c in zip(step.max_logit, step.gamma, stepped, clipped):
        assert torch.equal(gamma < 1, m > tau)
        assert c.tolist() == pytest.approx((s.double() * gamma).tolist(), rel=1e-5)
        over_tau += (c[m > tau] / tau).tolist()
        growth = (s / m)[m > tau]
        assert (c[m > tau] <= tau * growth * (1 + 1e-5)).all()
    assert 0 < len(over_tau) < sum(h.n_heads for h in clip.heads)
    assert max(over_tau) > 1.05, over_tau  # the promise is the scaling, not tau after the step
    clip.close()


def test_clip_factors_give_each_head_its_own_gamma():
    m = torch.tensor([50.0, 200.0, 80.0, 90.0, 400.0, 100.0])  # 3 kv groups of 2 heads
    gamma, qf, kf = clip_factors(m, 100.0, n_kv_heads=3)
    assert gamma.tolist() == [1.0, 0.5, 1.0, 1.0, 0.25, 1.0]
    assert (qf * kf.repeat_interleave(2)).tolist() == pytest.approx(gamma.tolist(), rel=1e-15)
    assert kf[1] == 1.0 and qf[2] == 1.0 and qf[3] == 1.0  # group 1: nothing clipped, nothing moves


# ---------------------------------------------------------------------------------- Hugging Face


def _hf(kind: str, seed=0):
    import transformers

    torch.manual_seed(seed)
    common = dict(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=32, attn_implementation="eager")
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    else:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common, head_dim=8))
    with torch.no_grad():  # layer 0's logits reach tens; layer 1 keeps its init's (under any tau used)
        attn = model.model.layers[0].self_attn
        for w in (attn.q_proj.weight, attn.k_proj.weight):
            w.mul_(6.0)
        if kind == "qwen3":  # its norms set the logits' scale
            attn.q_norm.weight.mul_(3.0)
            attn.k_norm.weight.mul_(3.0)
    return model


def _hf_reference(monkeypatch, kind):
    """{layer_idx: max logit per head} from the logits Hugging Face's own eager attention computes."""
    import importlib

    modeling = importlib.import_module(f"transformers.models.{kind}.modeling_{kind}")
    original = modeling.eager_attention_forward
    seen = {}

    def recording(module, query, key, value, attention_mask, scaling, **kw):
        k = modeling.repeat_kv(key, module.num_key_value_groups)
        logits = (query @ k.transpose(2, 3)).double() * scaling
        if attention_mask is not None:
            logits = logits.masked_fill(~attention_mask, -math.inf) if attention_mask.dtype == torch.bool else \
                logits + attention_mask
        seen[module.layer_idx] = logits.amax(dim=(0, 2, 3))
        return original(module, query, key, value, attention_mask, scaling, **kw)

    monkeypatch.setattr(modeling, "eager_attention_forward", recording)
    return seen


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_hf_records_its_post_rope_logits_and_clips_to_tau(monkeypatch, kind):
    model = _hf(kind)
    ref = _hf_reference(monkeypatch, kind)
    x = torch.randint(0, 100, (3, 10), generator=torch.Generator().manual_seed(2))
    clip = QKClip(model, tau=1e9)
    assert [h.n_kv_heads for h in clip.heads] == [2, 2]
    model(input_ids=x)
    recorded = clip.apply().max_logit
    for i, got in enumerate(recorded):
        assert got.tolist() == pytest.approx(ref[i].tolist(), rel=1e-5)
    clip.close()
    tau = float(recorded[0].sort().values[1])  # layer 0: one head under tau, three over
    assert float(recorded[1].max()) < tau  # layer 1 has no head over it
    clip = QKClip(model, tau=tau)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model(input_ids=x)
    step = clip.apply()
    model(input_ids=x)
    after = clip.apply().max_logit[0]
    # layer 0 sees the same input: each head's logits scaled by exactly its gamma, none over tau
    assert after.tolist() == pytest.approx((step.max_logit[0].double() * step.gamma[0]).tolist(), rel=1e-5)
    assert float(after.max()) <= tau * (1 + 1e-5)
    groups_seen = set()
    for layer, g in enumerate(step.gamma):
        attn = model.model.layers[layer].self_attn
        was = {s: before[f"model.layers.{layer}.self_attn.{s}.weight"] for s in ("q_proj", "k_proj", "q_norm", "k_norm")
               if f"model.layers.{layer}.self_attn.{s}.weight" in before}
        if kind == "llama":
            d = attn.head_dim
            for grp in range(2):  # kv group grp serves heads 2*grp, 2*grp + 1
                untouched = bool((g[2 * grp:2 * grp + 2] == 1).all())
                groups_seen.add(untouched)
                k_rows, q_rows = slice(grp * d, (grp + 1) * d), slice(2 * grp * d, (2 * grp + 2) * d)
                assert torch.equal(attn.k_proj.weight[k_rows], was["k_proj"][k_rows]) == untouched, (layer, grp, g)
                assert torch.equal(attn.q_proj.weight[q_rows], was["q_proj"][q_rows]) == untouched, (layer, grp, g)
        else:  # the shared norms carry the clip; the projections never move
            clipped = bool((g < 1).any())
            groups_seen.add(not clipped)
            assert torch.equal(attn.q_proj.weight, was["q_proj"]) and torch.equal(attn.k_proj.weight, was["k_proj"])
            assert torch.equal(attn.q_norm.weight, was["q_norm"]) != clipped
            assert torch.equal(attn.k_norm.weight, was["k_norm"]) != clipped
            assert len(set(g.tolist())) == 1  # the layer's heads share one factor
    assert groups_seen == {True, False}  # both a clipped and an untouched group (layer) were checked
    clip.close()


def test_hf_a_forward_continuing_a_kv_cache_is_not_recorded(monkeypatch):
    """Generation's forwards continue a cache: their keys start before their queries, which the
    recorded (top-left) causal mask does not see; they are left out with a warning."""
    model = _hf("llama")
    ref = _hf_reference(monkeypatch, "llama")
    x = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(3))
    clip = QKClip(model, tau=1e9)
    # the cache's name in this transformers: "cache" from 5.24, "past_key_values" before
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.no_grad():
        out = model(input_ids=x[:, :8], use_cache=True)  # from the first token: recorded
        first = [ref[i].clone() for i in range(2)]
        with pytest.warns(RuntimeWarning, match="did not record a forward of LlamaAttention that continued a KV "
                                                "cache of 8 earlier tokens"):
            model(input_ids=x[:, 8:], use_cache=True, **{name: out[name]})
    for got, want in zip(clip.apply().max_logit, first):
        assert got.tolist() == pytest.approx(want.tolist(), rel=1e-5)
    clip.close()


# ---------------------------------------------------------------------------------- training helper


def test_train_records_and_clips_with_qk_clip():
    from muonlab.train import train

    model = _gpt(boost=4.0)
    opt = Muon(muon_param_groups(model, adamw_lr=1e-3), lr=0.02, ns_dtype=torch.float32)
    hist = train(model, opt, steps=3, batch_size=2, progress=False, qk_clip=6.0)
    assert len(hist.max_logit) == 3 and hist.max_logit[0].shape == (2, 3)
    assert hist.qk_clipped[0] > 0 and hist.max_logit[0].max() > 6.0
    assert hist.qk_overshoot == pytest.approx([float(m.max()) / 6.0 for m in hist.max_logit], rel=1e-6)
    assert not any(b.attn.qk_recording for b in model.blocks)  # the run leaves no recording behind
    assert not opt._optimizer_step_post_hooks
    with pytest.raises(ValueError, match="qk_clip"):
        train(model, opt, steps=1, batch_size=2, progress=False, qk_clip=-1.0)


# ---------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("tau", [0, -1.0, float("nan"), True, "100"])
def test_bad_tau_is_refused(tau):
    model = _gpt()
    with pytest.raises(ValueError, match="tau must be a number > 0"):
        QKClip(model, tau=tau)
    assert not any(b.attn.qk_recording for b in model.blocks)


def test_a_model_without_attention_or_a_module_without_heads_is_refused_before_anything_changes():
    with pytest.raises(ValueError, match="found no attention module in Sequential"):
        QKClip(nn.Sequential(nn.Linear(4, 4)))
    model = _gpt()
    with pytest.raises(TypeError, match=r"cannot read the heads of 'lm_head' \(Linear\)"):
        QKClip(model, modules=[model.blocks[0].attn, model.lm_head])
    assert not model.blocks[0].attn.qk_recording
    with pytest.raises(TypeError, match="modules\\[0\\] must be an attention nn.Module or a QKHeads"):
        QKClip(model, modules=["blocks.0.attn"])
    with pytest.raises(ValueError, match="n_kv_heads=2 must divide n_heads=3"):
        QKHeads("mine", model.blocks[0].attn, 3, 2, 8, q=((model.blocks[0].attn.qkv.weight, 0),),
                k=((model.blocks[0].attn.qkv.weight, 24),))
    with pytest.raises(ValueError, match=r"k rows 64 \.\. 88"):
        QKHeads("mine", model.blocks[0].attn, 3, 3, 8, q=((model.blocks[0].attn.qkv.weight, 0),),
                k=((model.blocks[0].attn.qkv.weight, 64),))


def test_attach_refuses_what_is_not_an_optimizer_before_anything_changes():
    model = _gpt()
    clip = QKClip(model, tau=10.0)
    with pytest.raises(TypeError, match=r"QKClip.attach\(optimizer\) takes the torch.optim.Optimizer .* got str 'adam'"):
        clip.attach("adam")
    assert clip._step_handle is None  # not attached: a real optimizer attaches afterwards
    opt = Muon(muon_param_groups(model), lr=0.02)
    assert clip.attach(opt) is clip and len(opt._optimizer_step_post_hooks) == 1
    clip.close()


def test_hf_attention_with_unreadable_heads_is_refused():
    model = _hf("llama")
    attn = model.model.layers[0].self_attn
    attn.k_proj = nn.Linear(32, 12, bias=False)
    with pytest.raises(TypeError, match="k_proj 12, not 4 and 2 heads x head_dim 8"):
        QKClip(model)
    assert not hasattr(model.model.layers[1].self_attn, "qk_recording")


def test_compare_takes_qk_clip_per_configuration():
    from muonlab.experiments.compare import compare

    model = GPTConfig(d_model=16, n_heads=2, n_layers=1, context=8)
    with pytest.raises(ValueError, match="configuration 'clip': tau must be a number > 0"):
        compare({"clip": dict(qk_clip=0)}, model=model, seeds=(0,), steps=2, progress=False)
    result = compare({"muon": {}, "clip": dict(qk_clip=1e-3)}, model=model, seeds=(0,), steps=2, progress=False)
    runs = {r.config: r for c in result.configs.values() for r in c.runs}
    assert runs["clip"].train_loss[0] == runs["muon"].train_loss[0]  # same start, same first batch
    assert runs["clip"].train_loss[1] != runs["muon"].train_loss[1]  # every head clipped after step 1


def test_training_with_qk_clip_resumes_from_a_state_dict_and_offloads_bit_for_bit(tmp_path):
    """QK-clip keeps no state of its own (each step's clip reads that step's forward), so a run
    resumed from a state dict saved after step 2, and runs with the optimizer state in host memory
    or on disk, take the same clipped steps bit for bit as the resident run."""
    import io

    batches = [_tokens(seed) for seed in range(3)]

    def train(model, opt, steps):
        clip = QKClip(model, tau=10.0).attach(opt)
        for x in steps:
            model(x[:, :-1], x[:, 1:]).backward()
            opt.step()
            opt.zero_grad()
        clip.close()
        return sum(s.clipped_heads for s in clip.history)

    def optimizer(model, **extra):
        return Muon(muon_param_groups(model), ns_dtype=torch.float32, lr=0.05, **extra)

    model = _gpt()
    opt = optimizer(model)
    clipped = train(model, opt, batches[:2])
    saved = io.BytesIO()
    torch.save((model.state_dict(), opt.state_dict()), saved)
    clipped += train(model, opt, batches[2:])
    assert clipped > 0  # the clip did act on this run
    want = {n: p.detach().clone() for n, p in model.named_parameters()}
    for extra in (dict(state_offload="cpu"), dict(state_offload="disk", offload_dir=str(tmp_path / "disk"))):
        other = _gpt()
        train(other, optimizer(other, **extra), batches)
        assert all(torch.equal(p, want[n]) for n, p in other.named_parameters()), extra
    saved.seek(0)
    model_state, opt_state = torch.load(saved, weights_only=False)
    resumed = _gpt()
    resumed.load_state_dict(model_state)
    opt = optimizer(resumed)
    opt.load_state_dict(opt_state)
    train(resumed, opt, batches[2:])
    assert all(torch.equal(p, want[n]) for n, p in resumed.named_parameters())
