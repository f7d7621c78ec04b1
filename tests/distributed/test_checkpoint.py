"""muonlab.checkpoint on real gloo workers: exact resume and resharding.

Process start-up dominates on a 2-core machine, so the cases share four launches:
  A  4 ranks: fsdp fp32, fsdp bf16, ep fp32: 8 steps straight; 4 steps + save
  B  2 ranks: ddp: straight + save; fsdp fp32 save on 2; load the 4-rank fsdp checkpoint (+1 step)
  C  4 ranks (new processes): resume A's cases; load B's 2-rank fsdp checkpoint (+1 step)
  D  2 ranks (new processes): resume the ddp case
plus loads in this process without torch.distributed (1 rank, plain and unsharded model).
"""

from __future__ import annotations

import pytest
import torch

from muonlab import checkpoint
from muonlab.launcher import launch
from tests.distributed import _workers_ckpt as W

CASES4 = [("fsdp", "fp32"), ("fsdp", "bf16"), ("ep", "fp32")]
CASES2 = [("ddp", "fp32")]


def _equal(a, b, what):
    assert a.keys() == b.keys(), what
    for k in a:
        x, y = a[k], b[k]
        if torch.is_tensor(x):
            assert x.dtype == y.dtype and torch.equal(x, y), f"{what}: {k} differs"
        else:
            assert x == y, f"{what}: {k}: {x} != {y}"


def _same_snapshot(a, b, what):
    _equal(a["params"], b["params"], what + " params")
    _equal(a["state"], b["state"], what + " optimizer state")
    assert a["sched"] == b["sched"], what + " scheduler"
    assert a["lrs"] == b["lrs"], what + " lrs"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ckpt"))
    # cold (warm=False): each resume reads the checkpoint alone, in processes that never held the run
    a = launch(W.phase, 4, [("save", "save_run", (CASES4, root))], timeout_s=240, warm=False)
    b = launch(W.phase, 2, [("save", "save_run", (CASES2 + [("fsdp", "fp32")], root)),
                            ("reshard", "reshard_load", (root, 4))], timeout_s=240, warm=False)
    c = launch(W.phase, 4, [("resume", "resume_run", (CASES4, root, 4)),
                            ("reshard", "reshard_load", (root, 2))], timeout_s=240, warm=False)
    d = launch(W.phase, 2, [("resume", "resume_run", (CASES2, root, 2))], timeout_s=240, warm=False)
    return dict(root=root, a=a, b=b, c=c, d=d)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", CASES4 + CASES2, ids=lambda c: "-".join(c))
def test_exact_resume_in_new_processes(runs, case):
    save, resume = (runs["a"], runs["c"]) if case in CASES4 else (runs["b"], runs["d"])
    for rank in save:
        straight = save[rank]["save"][case]["straight"]
        saved = save[rank]["save"][case]["saved"]
        got = resume[rank]["resume"][case]
        assert got["step"] == W.SAVE_AT and got["meta_extra"] == {"case": case[0]}
        _same_snapshot(saved, got["loaded"], f"rank {rank} right after load")
        _same_snapshot(straight, got["resumed"], f"rank {rank} 4+4 vs 8")
        assert straight["losses"] == saved["losses"] + got["resumed"]["losses"]
        # momentum resumes in the parameter's dtype (Muon's default), AdamW moments in fp32
        param_dtype = torch.bfloat16 if case[1] == "bf16" else torch.float32
        assert all(dt == (param_dtype if key == "momentum_buffer" else torch.float32)
                   for (_, key), dt in got["resumed"]["state_dtypes"].items() if key != "step")
        # the frozen parameters had state created (zeros) at the save and were stepped after it
        kind = "moe" if case[0] == "ep" else "gpt"
        for name in W.FROZEN[kind]:
            assert any(k[0] == name for k in saved["state"])
    if case == ("fsdp", "bf16"):
        assert all(p.dtype == torch.bfloat16 for p in got["resumed"]["params"].values())


@pytest.mark.timeout(600)
def test_reshard_4_to_2_and_2_to_4(runs):
    saved4 = runs["a"][0]["save"][("fsdp", "fp32")]["saved"]
    saved2 = runs["b"][0]["save"][("fsdp", "fp32")]["saved"]
    for rank, res in runs["b"].items():  # 4 -> 2
        _same_snapshot(saved4, res["reshard"]["loaded"], f"4->2 rank {rank}")
        assert res["reshard"]["step"] == W.SAVE_AT and len(res["reshard"]["losses"]) == 1
    for rank, res in runs["c"].items():  # 2 -> 4
        _same_snapshot(saved2, res["reshard"]["loaded"], f"2->4 rank {rank}")
        assert len(res["reshard"]["losses"]) == 1


@pytest.mark.timeout(120)
def test_reshard_4_to_1_without_process_group(runs):
    import torch.distributed as dist

    assert not dist.is_initialized()
    saved4 = runs["a"][0]["save"][("fsdp", "fp32")]["saved"]
    res = W.reshard_load(runs["root"], 4, layout="plain")
    _same_snapshot(saved4, res["loaded"], "4->1")
    assert res["step"] == W.SAVE_AT and len(res["losses"]) == 1


@pytest.mark.timeout(120)
def test_saved_param_groups_hold_no_names_and_bad_inputs_are_named(runs, tmp_path):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from muonlab import Muon, muon_param_groups
    from muonlab.models import GPT, GPTConfig

    path = runs["a"][0]["save"][("fsdp", "fp32")]["path"]
    model, _, opt, sched, _ = W.build("plain")
    _, osd = get_state_dict(model, opt)
    osd = checkpoint._strip_param_names(osd)
    assert all("param_names" not in g for g in osd["param_groups"])
    # the saved optimizer param_groups, read back
    import torch.distributed.checkpoint as dcp

    saved_keys = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    assert "optim.param_groups.0.lr" in saved_keys  # param_groups are flattened into the keys
    assert not any("param_names" in k for k in saved_keys)

    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        checkpoint.load(str(tmp_path / "nothing"), model, opt)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="not a complete"):
        checkpoint.load(str(tmp_path / "empty"), model, opt)
    wide = GPT(GPTConfig(**{**W.GPT_CFG, "d_model": 32}))
    _load_fails(path, wide, Muon(muon_param_groups(wide)),
                r"'tok_emb.weight' has shape \(256, 24\) in the checkpoint and \(256, 32\)")
    deep = GPT(GPTConfig(**{**W.GPT_CFG, "n_layers": 3}))
    _load_fails(path, deep, Muon(muon_param_groups(deep)), r"no parameter 'blocks.2")
    shallow = GPT(GPTConfig(**{**W.GPT_CFG, "n_layers": 1}))
    _load_fails(path, shallow, Muon(muon_param_groups(shallow)),
                r"parameter 'blocks.1.* in the checkpoint but not in the model")
    with pytest.raises(ValueError, match="no lr scheduler"):
        m2, _, o2, s2, _ = W.build("plain")
        checkpoint.save(tmp_path / "nosched", m2, o2, 0)
        checkpoint.load(tmp_path / "nosched", m2, o2, scheduler=s2)


@pytest.mark.timeout(60)
def test_expert_checkpoint_needs_the_same_ep_size(runs):
    from muonlab import Muon, muon_param_groups
    from muonlab.models import GPT
    from muonlab.models.gpt import moe_config

    path = runs["a"][0]["save"][("ep", "fp32")]["path"]
    model = GPT(moe_config(**W.MOE_CFG))  # no expert parallelism: one unsplit bank
    _load_fails(path, model, Muon(muon_param_groups(model), **W.HYPER),
                r"expert parallelism: expert bank 'blocks.0.mlp.w_in' is saved as \['ep0of2', 'ep1of2'\]")


def _everything(model, opt) -> dict:
    """Every bit a load could change: parameters (by storage, so tied ones once), optimizer state
    (which parameters have it, its keys and values), param_groups' hyper-parameters."""
    names = {p: n for n, p in model.named_parameters()}
    return dict(
        params={n: p.detach().clone() for n, p in model.named_parameters()},
        state={names[p]: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
               for p, s in opt.state.items()},
        groups=[{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
    )


def _load_fails(path, model, opt, match):
    before = _everything(model, opt)
    with pytest.raises(ValueError, match=match):
        checkpoint.load(path, model, opt)
    _assert_unchanged(before, _everything(model, opt), f"failed load of {path}")


def _assert_unchanged(before, after, what):
    _equal(before["params"], after["params"], what + " params")
    assert before["state"].keys() == after["state"].keys(), what
    for name in before["state"]:
        _equal(before["state"][name], after["state"][name], f"{what} state of {name}")
    assert before["groups"] == after["groups"], what


def _small_gpt(tie: bool, seed: int, steps: int, split_adamw: int | None = None):
    """A stepped GPT and its Muon; ``split_adamw``: the AdamW group split in two at that index."""
    from muonlab import Muon, muon_param_groups
    from muonlab.models import GPT, GPTConfig

    torch.manual_seed(seed)
    model = GPT(GPTConfig(vocab_size=32, context=8, d_model=16, n_layers=1, n_heads=2, tie_embeddings=tie))
    groups = muon_param_groups(model)
    if split_adamw is not None:
        adamw = groups[1]
        groups[1] = {**adamw, "params": adamw["params"][:split_adamw]}
        groups.append({**adamw, "params": adamw["params"][split_adamw:], "weight_decay": 0.0})
    opt = Muon(groups, **W.HYPER)
    for step in range(steps):
        idx = torch.randint(0, 32, (2, 9), generator=torch.Generator().manual_seed(step))
        model(idx[:, :-1], idx[:, 1:]).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


@pytest.mark.timeout(120)
def test_a_failing_load_changes_nothing(tmp_path):
    untied, opt = _small_gpt(tie=False, seed=0, steps=2)
    checkpoint.save(tmp_path / "untied", untied, opt, 2)
    tied, opt = _small_gpt(tie=True, seed=0, steps=2)
    checkpoint.save(tmp_path / "tied", tied, opt, 2)
    # a checkpoint from before save() recorded tied parameters: caught by its optimizer state keys
    (tmp_path / "untied_old").mkdir()
    for f in (tmp_path / "untied").iterdir():
        (tmp_path / "untied_old" / f.name).write_bytes(f.read_bytes())
    meta = torch.load(tmp_path / "untied_old" / checkpoint.META_FILE, weights_only=False)
    meta.pop("tied", None)
    torch.save(meta, tmp_path / "untied_old" / checkpoint.META_FILE)

    cases = [  # (checkpoint, tie the model, steps taken before the load, error)
        ("untied", True, 1, r"tied parameters: the checkpoint ties no parameters, the model ties "
                            r"'lm_head.weight' = 'tok_emb.weight'"),
        ("untied", True, 0, "tied parameters"),  # a fresh optimizer: its state must stay empty
        ("untied_old", True, 1, r"optimizer state 'lm_head.weight\..*' for a parameter the optimizer does not have"),
        ("untied_old", True, 0, "optimizer state 'lm_head.weight"),
        ("tied", False, 1, r"the checkpoint ties 'lm_head.weight' = 'tok_emb.weight', the model ties no parameters"),
    ]
    for name, tie, steps, error in cases:
        model, opt = _small_gpt(tie=tie, seed=5, steps=steps)
        _load_fails(tmp_path / name, model, opt, error)

    # parameter groups that hold other parameters than at the save
    untied, opt = _small_gpt(tie=False, seed=0, steps=1, split_adamw=2)
    checkpoint.save(tmp_path / "split2", untied, opt, 1)
    for split, steps, error in [
        (None, 1, "it has 3 parameter groups, the optimizer 2"),
        (3, 0, "parameter group 1 holds 2 parameters in the checkpoint and 3 in the optimizer"),
    ]:
        model, opt = _small_gpt(tie=False, seed=5, steps=steps, split_adamw=split)
        _load_fails(tmp_path / "split2", model, opt, error)
    model, opt = _small_gpt(tie=False, seed=5, steps=1, split_adamw=2)
    assert checkpoint.load(tmp_path / "split2", model, opt) == 1  # the same groups load
