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
from muonlab.distributed import launch
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
    a = launch(W.phase, 4, [("save", "save_run", (CASES4, root))], timeout_s=240)
    b = launch(W.phase, 2, [("save", "save_run", (CASES2 + [("fsdp", "fp32")], root)),
                            ("reshard", "reshard_load", (root, 4))], timeout_s=240)
    c = launch(W.phase, 4, [("resume", "resume_run", (CASES4, root, 4)),
                            ("reshard", "reshard_load", (root, 2))], timeout_s=240)
    d = launch(W.phase, 2, [("resume", "resume_run", (CASES2, root, 2))], timeout_s=240)
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
        # momentum and AdamW moments stay fp32 whatever the parameter dtype
        assert all(dt == torch.float32 for (_, key), dt in got["resumed"]["state_dtypes"].items() if key != "step")
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
    with pytest.raises(ValueError, match=r"'tok_emb.weight' has shape \(256, 24\) in the checkpoint and \(256, 32\)"):
        checkpoint.load(path, wide, Muon(muon_param_groups(wide)))
    deep = GPT(GPTConfig(**{**W.GPT_CFG, "n_layers": 3}))
    with pytest.raises(ValueError, match=r"no parameter 'blocks.2"):
        checkpoint.load(path, deep, Muon(muon_param_groups(deep)))
    shallow = GPT(GPTConfig(**{**W.GPT_CFG, "n_layers": 1}))
    with pytest.raises(ValueError, match=r"parameter 'blocks.1.* in the checkpoint but not in the model"):
        checkpoint.load(path, shallow, Muon(muon_param_groups(shallow)))
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
    with pytest.raises(ValueError, match=r"expert parallelism: expert bank 'blocks.0.mlp.w_in' is saved as "
                                         r"\['ep0of2', 'ep1of2'\]"):
        checkpoint.load(path, model, Muon(muon_param_groups(model), **W.HYPER))
