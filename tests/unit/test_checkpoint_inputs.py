"""Checkpoints, offloaded state and simulate() under bad or lossy input: refused before anything
is written or loaded, or kept whole (single process)."""

import gc
import os
import warnings

import pytest
import torch

from muonlab import Muon, checkpoint, muon_param_groups
from muonlab.models import GPT, GPTConfig
from muonlab.simulate import simulate, summarize

CFG = dict(d_model=16, n_layers=1, n_heads=2, context=8)


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _build(seed=0, dtype=torch.float32, **options):
    torch.manual_seed(seed)
    model = GPT(GPTConfig(**CFG)).to(dtype)
    return model, Muon(muon_param_groups(model), lr=0.02, weight_decay=0.01, **options)


def _train(model, opt, steps=2, seed=1):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randint(0, 256, (2, 8), generator=gen)
        model(x, x).backward()
        opt.step()
        opt.zero_grad()


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("step, extra, error", [
    (None, None, TypeError),
    ("x", None, TypeError),
    (7, lambda: None, Exception),  # a lambda can't be pickled
    (-5, None, ValueError),  # resumed training would run range(-5, steps)
])
def test_a_refused_save_leaves_the_older_checkpoint_whole(tmp_path, step, extra, error):
    path = tmp_path / "ckpt"
    model, opt = _build()
    _train(model, opt)
    checkpoint.save(path, model, opt, step=3)
    saved = _params(model)
    _train(model, opt, seed=2)
    with pytest.raises(error):
        checkpoint.save(path, model, opt, step=step, extra=extra)
    again, opt2 = _build(seed=5)
    assert checkpoint.load(path, again, opt2) == 3
    assert _same(_params(again), saved)
    assert sorted(os.listdir(path)) == sorted(f for f in os.listdir(path) if not f.endswith(".tmp"))


def test_a_data_file_cut_short_is_refused_before_anything_loads(tmp_path):
    path = tmp_path / "ckpt"
    model, opt = _build()
    _train(model, opt)
    checkpoint.save(path, model, opt, step=3)
    data = next(f for f in os.listdir(path) if f.endswith(".distcp"))
    with open(path / data, "r+b") as f:
        f.truncate(os.path.getsize(path / data) - 100)
    other, opt2 = _build(seed=5)
    _train(other, opt2)
    before = _params(other)
    with pytest.raises(ValueError, match=rf"is damaged: {data} holds \d+ bytes, its metadata needs \d+"):
        checkpoint.load(path, other, opt2)
    assert _same(_params(other), before)


def test_loading_into_a_narrower_dtype_is_refused(tmp_path):
    path = tmp_path / "ckpt"
    model, opt = _build()
    _train(model, opt)
    checkpoint.save(path, model, opt, step=3)
    narrow, opt2 = _build(dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"holds '.*' in torch.float32, the model/optimizer in torch.bfloat16"):
        checkpoint.load(path, narrow, opt2)


@pytest.mark.parametrize("place", ["cpu", "disk"])
def test_offloaded_state_of_another_dtype_loads_cast_as_resident_state_does(tmp_path, place):
    """fp32 momentum into bf16 momentum slots: cast, as without offload (it was refused after
    the optimizer's groups and state were already replaced)."""
    model, opt = _build(dtype=torch.bfloat16, momentum_dtype=torch.float32)
    _train(model, opt)
    sd = opt.state_dict()
    kw = dict(offload_dir=str(tmp_path)) if place == "disk" else {}
    resident_model, resident = _build(dtype=torch.bfloat16)
    offloaded_model, offloaded = _build(dtype=torch.bfloat16, state_offload=place, **kw)
    resident.load_state_dict(sd)
    offloaded.load_state_dict(sd)
    for p, q in zip(resident_model.parameters(), offloaded_model.parameters()):
        for key, value in resident.state[p].items():
            assert torch.equal(value, offloaded.state[q][key].to(value.device)), key


def test_a_new_disk_state_file_leaves_an_older_state_dict_whole(tmp_path):
    model, opt = _build(state_offload="disk", offload_dir=str(tmp_path))
    _train(model, opt)
    sd = opt.state_dict()
    held = {(pid, k): v.clone() for pid, s in sd["state"].items() for k, v in s.items()}
    del opt
    gc.collect()
    _build(state_offload="disk", offload_dir=str(tmp_path))  # the same directory, a new file
    assert all(torch.equal(sd["state"][pid][k], v) for (pid, k), v in held.items())


@pytest.mark.parametrize("shapes, mesh, error, match", [
    ([("w", (-64, 32))], 4, ValueError, r"'w' has shape \(-64, 32\): its dims must be >= 1, got -64"),
    ([("w", (0, 32))], 4, ValueError, r"'w' has shape \(0, 32\): its dims must be >= 1, got 0"),
    ([("w", (64.7, 32))], 4, TypeError, r"'w' has shape \(64.7, 32\): its dims must be ints"),
    ([("w", (64, 32))], (2, 2.5), TypeError, r"mesh_shape \(2, 2.5\): its sizes must be ints"),
    ([("w", (64, 32))], 4.0, TypeError, r"mesh_shape must be W, \(W,\) or \(fsdp, ep\)"),
])
def test_simulate_names_a_bad_shape_or_mesh(shapes, mesh, error, match):
    with pytest.raises(error, match=match):
        simulate(shapes, mesh)


def test_simulate_checks_fused_banks_as_muon_does():
    with pytest.raises(ValueError, match=r"fused_banks names \['nope'\]"):
        simulate([("w", (64, 32))], 4, fused_banks={"nope": 2})
    with pytest.raises(ValueError, match=r"fused_banks\['w'\] must be >= 1"):
        simulate([("w", (64, 32))], 4, fused_banks={"w": 0})


def test_the_bound_is_a_lower_bound_for_experts_in_place_and_tiny_row_shards():
    local = summarize(simulate([("experts", (64, 256, 128))], (8, 1)), 8)
    assert (local["total_bytes"], local["bound_bytes"], local["bytes_over_bound"]) == (0, 0, 1.0)
    # 1024 rows over 2048 ranks: half the ranks hold one row, half nothing; the owner holds one
    tiny = summarize(simulate([(f"w{i}", (1024, 1024)) for i in range(4)], 2048), 2048)
    assert tiny["total_bytes"] >= tiny["bound_bytes"] == round(4 * 2 * (1 - 1 / 1024) * 1024 * 1024 * 2)


def test_summarize_wants_the_plans_world():
    plan = simulate([("w", (64, 32))], 4)
    for world in (2, 8, 0, -1, 4.0):
        with pytest.raises(ValueError, match=r"world must be the plan's world size \(4\)"):
            summarize(plan, world)
    alone = simulate([("w", (64, 32))], 1)  # every batch on one process: its world is 1
    assert summarize(alone, 1)["flop_imbalance"] == 1.0
    with pytest.raises(ValueError, match=r"world must be the plan's world size \(1\)"):
        summarize(alone, 8)


def test_the_bound_counts_the_plans_own_wire_dtype():
    shapes = [(f"w{i}", (64, 32)) for i in range(8)]
    for dtype in (torch.bfloat16, torch.float32):
        s = summarize(simulate(shapes, 4, comm_dtype=dtype), 4)
        assert s["bytes_over_bound"] == 1.0, (dtype, s)
        assert s["bound_bytes"] == 8 * 2 * (3 / 4) * 64 * 32 * dtype.itemsize, (dtype, s)


def test_save_refuses_a_path_that_is_an_existing_file(tmp_path):
    path = tmp_path / "not_a_folder"
    path.write_text("x")
    model, opt = _build()
    with pytest.raises(FileExistsError, match="is an existing file"):
        checkpoint.save(path, model, opt, step=1)
    assert path.read_text() == "x"


def test_the_count_of_skipped_steps_survives_a_checkpoint(tmp_path):
    model, opt = _build()
    _train(model, opt)
    for p in model.parameters():
        p.grad = torch.full_like(p, float("inf"))
    opt.step()  # skipped: an inf gradient
    assert opt.skipped_steps == 1
    checkpoint.save(tmp_path / "ck", model, opt, step=3)
    model2, opt2 = _build(seed=1)
    checkpoint.load(tmp_path / "ck", model2, opt2)
    assert opt2.skipped_steps == 1
